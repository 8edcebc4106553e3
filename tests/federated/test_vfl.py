"""Two-party split learning (synchronous, on Flower) and PubSub-VFL: the defining properties.

- synchronous split learning computes exactly the centralised model on the concatenated
  columns: same gradients and, step after step, same parameters (1e-6);
- PubSub-VFL with one worker per party and staleness 0 is the synchronous run;
- the bytes that cross equal 2 * |B| * e * 4 per step (+ 8 * |B| row ids, + the test embeddings);
- bad configs end in one line, exit 2.
"""
from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.federated.vfl.config import VFLConfig
from rankwise.federated.vfl.parties import batch_order, build_models, load_data
from rankwise.federated.vfl.pubsub import ParameterServer, choose_config, predicted_epoch_s, train_pubsub
from rankwise.federated.vfl.run import train
from rankwise.federated.vfl.sync import ActiveParty, PassiveParty, train_sync
from rankwise.testing import error_lines

# the tables ship with scikit-learn (read from its CSV files, without importing it)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn's data files")

SMALL = dict(dataset="wine", hidden=16, embed=4, top_hidden=8, batch_size=16, epochs=2, lr=0.1)


def centralised_step(passive, active, data, ids):
    """The concatenated model g([f_p(x_p), f_a(x_a)]) on one batch: loss.backward()."""
    logits = active(passive(data.x_passive[ids]), data.x_active[ids])
    F.cross_entropy(logits, data.y[ids]).backward()


def test_sync_gradients_equal_centralised_training():
    cfg = VFLConfig(**SMALL, momentum=0.9)
    data = load_data(cfg)
    p_model, a_model = build_models(cfg, data)
    p_ref, a_ref = copy.deepcopy(p_model), copy.deepcopy(a_model)
    opt = torch.optim.SGD(list(p_ref.parameters()) + list(a_ref.parameters()), lr=cfg.lr, momentum=0.9)
    passive = PassiveParty(cfg, p_model, data.x_passive, data.x_passive_test)
    active = ActiveParty(cfg, a_model, data)
    for step, ids in enumerate(batch_order(len(data.y), cfg.batch_size, 1, cfg.seed)[:4]):
        grad, _ = active.step(ids, passive.forward(step, ids))
        passive.backward(step, grad)
        opt.zero_grad()
        centralised_step(p_ref, a_ref, data, ids)
        for mine, ref in ((p_model, p_ref), (a_model, a_ref)):
            for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)
        opt.step()
        for mine, ref in ((p_model, p_ref), (a_model, a_ref)):
            for p, q in zip(mine.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def _run(cfg):
    data = load_data(cfg)
    p, a = build_models(cfg, data)
    out = (train_pubsub if cfg.mode == "pubsub" else train_sync)(cfg, data, p, a)
    return out, p, a


def test_flower_engine_equals_direct_calls():
    flower, p1, a1 = _run(VFLConfig(**SMALL, engine="flower"))
    direct, p2, a2 = _run(VFLConfig(**SMALL, engine="direct"))
    assert flower["losses"] == pytest.approx(direct["losses"], abs=1e-6)
    assert flower["traffic"] == direct["traffic"]
    for p, q in zip(list(p1.parameters()) + list(a1.parameters()), list(p2.parameters()) + list(a2.parameters())):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("latency_ms", [0.0, 1.0])  # latency must not move the evaluations
def test_pubsub_one_worker_staleness_zero_equals_sync(latency_ms):
    sync, p1, a1 = _run(VFLConfig(**SMALL, engine="direct", momentum=0.5))
    pubsub, p2, a2 = _run(VFLConfig(**SMALL, mode="pubsub", workers_passive=1, workers_active=1,
                                     staleness=0, buffer=1, momentum=0.5, latency_ms=latency_ms))
    assert pubsub["dropped"] == 0 and pubsub["staleness_passive"] == {0: sync["steps"]}
    assert pubsub["losses"] == pytest.approx(sync["losses"], abs=1e-6)
    assert [r["accuracy"] for r in pubsub["curve"]] == [r["accuracy"] for r in sync["curve"]]
    for p, q in zip(list(p1.parameters()) + list(a1.parameters()), list(p2.parameters()) + list(a2.parameters())):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode,workers", [("sync", 1), ("pubsub", 1), ("pubsub", 3)])
def test_bytes_crossed_equal_the_formula(mode, workers):
    # wine: 178 rows, 36 test (round(0.2 * 178)), 142 train = 8 batches of 16 + one of 14 per epoch
    cfg = VFLConfig(**SMALL, mode=mode, engine="flower", workers_passive=workers, workers_active=workers)
    _, m = train(cfg)
    assert m["batch_sizes"] == ([16] * 8 + [14]) * 2
    assert m["traffic"]["embeddings"] == m["traffic"]["gradients"] == 2 * 142 * 4 * 4 == 4544
    assert m["train_bytes"] == m["train_bytes_formula"] == 9088
    assert m["id_bytes"] == 2 * 142 * 8
    assert m["eval_bytes"] == 2 * 36 * 4 * 4  # the test embeddings, once per epoch
    assert m["messages"]["embeddings"] == m["messages"]["gradients"] == 18


def test_stale_gradient_beyond_tau_is_dropped():
    model = torch.nn.Linear(2, 1)
    ps = ParameterServer(model, lr=1.0, momentum=0.0, staleness=1)
    replica = copy.deepcopy(model)
    replica.weight.grad, replica.bias.grad = torch.ones(1, 2), torch.ones(1)
    before = model.weight.detach().clone()
    assert ps.push(replica, 0) and ps.version == 1           # fresh: applied
    assert ps.push(replica, 0) and ps.version == 2           # 1 behind = tau: applied
    assert not ps.push(replica, 0) and ps.dropped == 1       # 2 behind > tau: dropped
    torch.testing.assert_close(model.weight, before - 2.0)


def test_predicted_epoch_time_and_the_choice_follow_the_profiles():
    prof = {"batch": 10, "t_passive": 0.04, "t_active": 0.01}
    # 100 rows = 10 batches; 1 worker each: the round trip 0.05 s limits -> 0.5 s
    assert predicted_epoch_s(prof, 100, 1, 1, (4, 4), 0.0) == pytest.approx(0.5)
    # 4 passive workers on 4 cores: 4 round trips in flight, 80 batches/s (the active party
    # could serve 100/s, the passive compute 100/s) -> 10 / 80
    assert predicted_epoch_s(prof, 100, 4, 1, (4, 4), 0.0) == pytest.approx(0.125)
    # cores cap the passive party's parallelism at 2
    assert predicted_epoch_s(prof, 100, 4, 1, (2, 4), 0.0) == pytest.approx(0.2)
    cfg = VFLConfig(**{**SMALL, "epochs": 1}, slow_party="passive", slow_factor=8.0, cores=[3, 3],
                    batch_sizes=[16], max_workers=3)
    data = load_data(cfg)
    choice = choose_config(cfg, data, *build_models(cfg, data))
    assert choice["workers_passive"] >= choice["workers_active"]  # the slow party gets the workers
    assert choice["staleness"] == max(choice["workers_passive"], choice["workers_active"])


@pytest.mark.slow  # parses the standard library's docstrings (~5 s unless another test did)
def test_docstrings_case_splits_token_positions():
    cfg = VFLConfig(dataset="docstrings", epochs=1, hidden=16, embed=4, top_hidden=8, batch_size=64, engine="direct")
    data = load_data(cfg)
    assert data.x_passive.shape[1] == data.x_active.shape[1] == 16 and data.x_passive.dtype == torch.int64
    _, m = train(cfg)
    assert m["train_bytes"] == m["train_bytes_formula"] == 2 * len(data.y) * 4 * 4


def _vfl_cli(tmp_path, section):
    path = tmp_path / "vfl.yaml"
    path.write_text(yaml.safe_dump({"vfl": section}))
    return CliRunner().invoke(main, ["vfl", str(path), "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("section,needle", [
    ({"passive_columns": [0, 1, 2], "active_columns": [2, 3]}, "columns [2] belong to both parties"),
    ({"labels": ["active", "passive"]}, "labels with both parties"),
    ({"passive_columns": [0, 30]}, "[30] out of range; breast_cancer has columns 0..29"),
    ({"mode": "pubsub", "staleness": -1}, "staleness: got -1"),
])
def test_bad_vfl_config_is_one_line_exit_2(tmp_path, section, needle):
    result = _vfl_cli(tmp_path, section)
    assert result.exit_code == 2, result.output
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_vfl_command_writes_the_run_folder(tmp_path):
    result = _vfl_cli(tmp_path, {**SMALL, "mode": "pubsub", "auto": True, "batch_sizes": [16]})
    assert result.exit_code == 0, result.output
    ran = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["vfl"]
    assert ran["batch_size"] == 16 and ran["staleness"] == max(ran["workers_passive"], ran["workers_active"])
    assert (tmp_path / "out" / "metrics.json").is_file()
    assert json.loads((tmp_path / "out" / "rankwise.json").read_text()) == {"kind": "vfl"}
