"""Reruns reproduce: whole federations driven in this process (no Ray) with the same config
end with the same numbers whatever the node ids Flower draws and whichever process serves a
node; the run reports ``majority_accuracy``; a frozen head never trains or travels."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import yaml

from rankwise.federated import client_app, keys
from rankwise.federated.inprocess import LocalGrid, run_inprocess
from rankwise.federated.task import build_client, build_session, load_run, majority_share

from fed_helpers import toy_config, write_toy_data


def write_config(tmp_path, **federated):
    raw = toy_config(write_toy_data(tmp_path / "toy.jsonl", n=96), **federated)
    path = tmp_path / f"run-{federated.get('strategy', 'fedit')}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def numbers(run) -> list[dict]:
    """Every line of ``rounds.jsonl`` without the wall-clock entries (the round's ``time_s``,
    LEFF's per-client ``importance_s``)."""
    lines = [json.loads(x) for x in (run / "rounds.jsonl").read_text().splitlines()]
    return [{k: v for k, v in e.items() if k not in ("time_s", "importance_s")} for e in lines]


class TwoProcesses(LocalGrid):
    """Serves each node from one of two process caches, switching every round, as Ray's
    actors may: a process finds its cached copy of a node one round old."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.caches: list[dict] = [{}, {}]

    def serve(self, msg):
        cfg = msg.content.config_records.get(keys.CONFIG)
        rnd = int(dict(cfg).get(keys.ROUND, 0)) if cfg is not None else 0
        part = int(self.contexts[msg.metadata.dst_node_id].node_config[keys.PARTITION])
        client_app._CLIENTS = self.caches[(part + rnd) % 2]
        return super().serve(msg)


def test_majority_share_is_the_most_frequent_labels_share():
    assert majority_share([0, 2, 2, 1, 2, 0]) == 0.5
    assert majority_share([3]) == 1.0
    assert majority_share([1, 0, 0, 1]) == 0.5
    assert majority_share(None) is None and majority_share([]) is None


def test_metrics_record_the_eval_splits_majority_share(tmp_path):
    """``majority_accuracy`` is the share of the evaluation split's most common label (the
    accuracy of always predicting it), counted here from the file with the split's own hash
    (``"{row}:{text}"``); the results table and rows carry it."""
    import random

    from rankwise.data.demo import split_of
    from rankwise.federated.run import write_results
    rng = random.Random(1)
    words = {"net": "socket stream loop", "mail": "header mime parse", "log": "logger handler level"}
    labels = ["net"] * 70 + ["mail"] * 30 + ["log"] * 20          # 58 % net overall
    rng.shuffle(labels)
    records = [{"text": f"{i} " + " ".join(rng.choices(words[y].split(), k=5)), "label": y}
               for i, y in enumerate(labels)]
    data = tmp_path / "skewed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    held = [r["label"] for row, r in enumerate(records) if split_of(f"{row}:{r['text']}", 0.3) == "eval"]
    expected = max(Counter(held).values()) / len(held)
    raw = toy_config(data, rounds=1, local_steps=1)
    raw["data"]["eval_fraction"] = 0.3
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    metrics = run_inprocess(path, tmp_path / "run")
    assert 20 <= len(held) <= 50 and Counter(held).most_common(1)[0][0] == "net"
    assert metrics["majority_accuracy"] == pytest.approx(expected, abs=1e-12)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["majority_accuracy"] == metrics["majority_accuracy"]
    rows = write_results({"fedit": tmp_path / "run"}, tmp_path / "table")
    assert rows["fedit"]["majority_accuracy"] == metrics["majority_accuracy"]
    table = (tmp_path / "table" / "results.md").read_text().splitlines()
    assert table[0].split(" | ")[4] == "majority" and table[2].split(" | ")[4] == f"{expected:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["rolora", "leff", "fedlease"])
def test_reruns_reproduce_whatever_the_node_ids(tmp_path, strategy):
    path = write_config(tmp_path, strategy=strategy, clients=3, rounds=3, local_steps=2,
                        fraction=0.67, min_clients=2)
    a = run_inprocess(path, tmp_path / "a", node_ids=[11, 12, 13])
    b = run_inprocess(path, tmp_path / "b", node_ids=[9_031_442, 17, 455_200])  # Flower draws random ids
    assert numbers(tmp_path / "a") == numbers(tmp_path / "b")
    assert {k: v for k, v in a.items() if k != "wall_time_s"} == {k: v for k, v in b.items() if k != "wall_time_s"}
    lines = numbers(tmp_path / "a")
    assert [e["round"] for e in lines] == [0, 1, 2, 3]
    if strategy != "fedlease":                      # 2 of 3 sampled per round (fedlease: all in warm-up)
        assert all(e["sampled"] == 2 for e in lines[1:])
    assert all(e["aggregated"] >= 2 for e in lines[1:]) and lines[-1]["eval_loss"] != lines[0]["eval_loss"]
    cfg, _, _ = load_run(path)
    labels = build_session(cfg).eval_data.labels
    assert a["majority_accuracy"] == max(Counter(labels).values()) / len(labels)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["rolora", "leff"])
def test_a_node_served_by_another_process_ends_the_same(tmp_path, strategy, monkeypatch):
    monkeypatch.setattr(client_app, "_CLIENTS", {})
    path = write_config(tmp_path, strategy=strategy, clients=2, rounds=4, local_steps=2)
    run_inprocess(path, tmp_path / "one")
    run_inprocess(path, tmp_path / "two", grid=TwoProcesses(path))
    # LEFF's logged block probabilities come from each client's importance pass, a gradient
    # reduction whose last digits follow the serving process's threads; the blocks drawn from
    # them, the losses and the bytes must still be equal
    one, two = numbers(tmp_path / "one"), numbers(tmp_path / "two")
    for e in one + two:
        e.pop("block_probabilities", None)
    assert one == two


def test_frozen_head_never_trains_or_travels(tmp_path):
    path = write_config(tmp_path, strategy="fedit", head="frozen", rounds=1)
    client = build_client(path, 0)
    params = dict(client.model.named_parameters())
    assert "classifier.weight" not in client.names and not params["classifier.weight"].requires_grad
    assert len(client.names) == 2 * 13 and set(client.roles) == set(client.names)
    head = params["classifier.weight"].detach().clone()
    metrics = run_inprocess(path, tmp_path / "run")
    assert metrics["rounds"] == 1 and metrics["bytes_up"] > 0
    served = [c for (_, pid), c in client_app._CLIENTS.items() if pid == 0][-1]
    assert torch.equal(dict(served.model.named_parameters())["classifier.weight"], head)
    assert "classifier.weight" not in served.params()
