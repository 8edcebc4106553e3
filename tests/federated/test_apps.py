"""The ClientApp and the server's Evaluator driven in-process (no Ray): a FedLEASE federation
whose clients become mixtures through the strategy's hooks, lose their process cache, and are
rebuilt from ``Context.state`` with the same tensors."""
from __future__ import annotations

import math

import pytest
import torch
import yaml

from rankwise.federated import client_app, keys
from rankwise.federated.server_app import Evaluator, build_strategy
from rankwise.federated.task import load_run

from fed_helpers import FakeGrid, toy_config, write_toy_data


@pytest.mark.slow
def test_fedlease_through_the_client_app(tmp_path):
    from flwr.app import ConfigRecord, Context, RecordDict
    raw = toy_config(write_toy_data(tmp_path / "toy.jsonl", n=96), strategy="fedlease", clients=3,
                     min_clients=3, local_steps=2)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg, fed, _ = load_run(path)
    evaluator = Evaluator(cfg, fed)
    strategy = build_strategy(cfg, fed, evaluator.initial(), evaluator.roles)
    assert set(strategy.roles.values()) == {"A", "B"} and len(strategy.roles) == 2 * 13
    nodes = {101: 0, 102: 1, 103: 2}
    ctx = {n: Context(run_id=1, node_id=n, node_config={keys.PARTITION: pid}, state=RecordDict(),
                      run_config={client_app.RUN_CONFIG_KEY: str(path)}) for n, pid in nodes.items()}
    grid = FakeGrid(nodes)
    client_app._CLIENTS.clear()
    evals = [evaluator(strategy)]
    for rnd in (1, 2, 3):
        if rnd == 3:   # a new process serves every node: the clients are rebuilt from Context.state
            kept = {pid: {k: v.detach().clone() for k, v in c.params().items()}
                    for (_, pid), c in client_app._CLIENTS.items()}
            client_app._CLIENTS.clear()
            for n, pid in nodes.items():
                rebuilt = client_app.get_client(ctx[n]).params()
                assert set(rebuilt) == set(kept[pid])
                assert all(torch.equal(rebuilt[k], kept[pid][k]) for k in rebuilt)
        msgs = list(strategy.configure_train(rnd, None, ConfigRecord(), grid))
        replies = [client_app.train(m, ctx[m.metadata.dst_node_id]) for m in msgs]
        strategy.aggregate_train(rnd, replies)
        h = strategy.history[-1]
        assert h["aggregated"] == 3 and not h["rejected"] and not h["failed"], h
        evals.append(evaluator(strategy))
    assert strategy.num_experts >= 1 and set(strategy.cluster) == set(nodes)
    for n in nodes:                       # the structure each client keeps in its state
        rec = dict(ctx[n].state.config_records[keys.STATE_STRUCTURE])
        assert rec[keys.CLUSTER] == strategy.cluster[n] and rec[keys.NUM_EXPERTS] == strategy.num_experts
    client = client_app._CLIENTS[next(iter(client_app._CLIENTS))]
    wire = client.params()
    assert sum(k.startswith("expert") for k in wire) == 2 * 13 * strategy.num_experts
    assert all(math.isfinite(e["eval_loss"]) and 0.0 <= e["eval_accuracy"] <= 1.0 for e in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert set(strategy.run_metrics()) <= {"fedlease_experts", "fedlease_silhouettes"}
    client_app._CLIENTS.clear()


def test_yoco_initial_global_adapter_is_built_by_the_strategy(tmp_path):
    """Server and clients build the initial adapter through the strategy: YOCO's B from the SVD
    of each base weight (non-zero), A zero, identical on both sides (same fingerprint)."""
    raw = toy_config(write_toy_data(tmp_path / "toy.jsonl", n=32), strategy="yoco")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg, fed, _ = load_run(path)
    evaluator = Evaluator(cfg, fed)
    init = evaluator.initial()
    a = [k for k, r in evaluator.roles.items() if r == "A"]
    b = [k for k, r in evaluator.roles.items() if r == "B"]
    assert a and len(a) == len(b)
    assert all(float(init[k].abs().max()) == 0 for k in a)
    assert all(float(init[k].abs().min()) > 0 for k in b)
    from rankwise.federated.strategies.base import fingerprint
    from rankwise.federated.task import build_client
    threads = torch.get_num_threads()
    try:  # Ray's client processes run on one thread, the server on several: the same bits
        for n in (1, 3):
            torch.set_num_threads(n)
            client = build_client(path, 0)
            assert fingerprint({k: p.detach() for k, p in client.params().items()}) == fingerprint(init)
    finally:
        torch.set_num_threads(threads)
