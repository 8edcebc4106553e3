"""FedLEASE: clustering of constructed client adapters, expert initialisation, per-cluster
averaging, its client hooks, and its mixture model under the adapter protocol."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rankwise.adapters.lora import LoraConfig, apply_lora
from rankwise.adapters.mixture import MixtureLoraLayer
from rankwise.core import disable_adapters, merge_adapters
from rankwise.core.protocol import adapter_modules
from rankwise.errors import RankwiseError
from rankwise.federated import keys
from rankwise.federated.config import FederatedConfig
from rankwise.federated.moe import is_moe, moe_wire_parameters, router_key, to_moe
from rankwise.federated.strategies.fedlease import (FedLease, FedLeaseConfig, b_distance,
                                                    cluster_clients, silhouette)
from rankwise.federated.wire import mark_wire, plain_parameters
from rankwise.testing import randomize_trainable, tiny_bert_cls, tiny_logits

from fed_helpers import FakeGrid, config_of, received, reply

A0 = "m.layer.0.q.lora_A.default.weight"
B0 = "m.layer.0.q.lora_B.default.weight"
A1 = "m.layer.1.q.lora_A.default.weight"
B1 = "m.layer.1.q.lora_B.default.weight"
ROLES = {A0: "A", B0: "B", A1: "A", B1: "B"}


def client_adapter(direction: torch.Tensor, scale: float, a: float) -> dict:
    """Two layers whose B matrices point along ``direction`` (the client's task)."""
    b = (direction * scale).reshape(4, 1)
    return {A0: torch.full((1, 3), a), B0: b, A1: torch.full((1, 3), a), B1: b.clone()}


def test_distance_silhouette_and_clustering_on_two_task_groups():
    e1, e2 = torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 1.0, 0, 0])
    tilt = torch.tensor([0, 0, 0.1, 0])
    states = [client_adapter(e1, 1, 0), client_adapter(e1 + tilt, 2, 0), client_adapter(e2, 1, 0),
              client_adapter(e2 + tilt, 3, 0), client_adapter(e1, 5, 0)]
    d = b_distance(states, ROLES)
    assert torch.allclose(d[0, 4], torch.tensor(0.0, dtype=torch.float64))   # scale does not matter
    assert torch.allclose(d[0, 2], torch.tensor(1.0, dtype=torch.float64))   # orthogonal tasks
    labels, scores = cluster_clients(d, max_k=4)
    assert labels == [0, 0, 1, 1, 0]
    assert max(scores, key=scores.get) == 2 and scores[2] > 0.9
    assert silhouette(d, [0, 1, 0, 1, 0]) < 0
    # the roles decide which tensors are B: calling the (equal) A factors "B" gives distance 0
    two = [client_adapter(e1, 1, 1.0), client_adapter(e2, 1, 1.0)]
    assert torch.allclose(b_distance(two, ROLES)[0, 1], torch.tensor(1.0, dtype=torch.float64))
    assert torch.allclose(b_distance(two, {A0: "B", A1: "B"}), torch.zeros(2, 2, dtype=torch.float64))


def test_warmup_clustering_builds_experts_and_averages_within_clusters():
    e1, e2 = torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 1.0, 0, 0])
    init = {A0: torch.zeros(1, 3), B0: torch.zeros(4, 1), A1: torch.zeros(1, 3), B1: torch.zeros(4, 1),
            "classifier.weight": torch.zeros(2, 3)}
    adapters = {1: client_adapter(e1, 1, 1.0), 2: client_adapter(e1, 3, 3.0),
                3: client_adapter(e2, 1, 5.0), 4: client_adapter(e2, 2, 7.0)}
    for n, st in adapters.items():
        st["classifier.weight"] = torch.full((2, 3), float(n))
    s = FedLease(FedLeaseConfig(max_experts=3), FederatedConfig(clients=4, min_clients=2), init, roles=ROLES)
    grid = FakeGrid([1, 2, 3, 4])
    from flwr.app import ConfigRecord
    msgs = list(s.configure_train(1, None, ConfigRecord(), grid))
    assert {config_of(m)[keys.PHASE] for m in msgs} == {"warmup"}
    s.aggregate_train(1, [reply(m, adapters[m.metadata.dst_node_id]) for m in msgs])
    assert s.num_experts == 2 and s.cluster == {1: 0, 2: 0, 3: 1, 4: 1}
    assert torch.allclose(s.global_state["expert0/" + A0], torch.full((1, 3), 2.0))   # mean of 1 and 3
    assert torch.allclose(s.global_state["expert1/" + B0], (e2 * 1.5).reshape(4, 1))
    assert torch.allclose(s.global_state["cluster1/classifier.weight"], torch.full((2, 3), 3.5))
    assert s.global_state[router_key(0, A0)].shape == (3, 3)     # (2M-1, d_in of A0's layer)
    assert s.run_metrics()["fedlease_experts"] == 2
    msgs = list(s.configure_train(2, None, ConfigRecord(), grid))
    m3 = next(m for m in msgs if m.metadata.dst_node_id == 3)
    cfg = config_of(m3)
    assert cfg[keys.CLUSTER] == 1 and cfg[keys.NUM_EXPERTS] == 2 and cfg[keys.TOP_M] == 2
    got = received(m3)
    assert any(k.startswith("expert0/") for k in got) and not any(k.startswith("cluster0/") for k in got)
    replies = []
    for m in msgs:
        node = m.metadata.dst_node_id
        replies.append(reply(m, {k: torch.full(v, float(node)) for k, v in s._expected[node].items()},
                             n=10 * node))
    s.aggregate_train(2, replies)
    assert torch.allclose(s.global_state["expert0/" + A0], torch.full((1, 3), (10 + 40) / 30))
    assert torch.allclose(s.global_state["expert1/" + A0], torch.full((1, 3), (90 + 160) / 70))
    views = s.eval_views()
    assert len(views) == 2 and views[1][1][keys.CLUSTER] == 1


def test_needs_roles():
    with pytest.raises(ValueError, match="roles"):
        FedLease(FedLeaseConfig(), FederatedConfig(clients=2), {A0: torch.zeros(1, 3)})


def lora_model() -> nn.Module:
    model = nn.Sequential()
    model.add_module("layer", nn.ModuleList([nn.Linear(3, 3)]))
    model.add_module("classifier", nn.Linear(3, 2))
    apply_lora(model, LoraConfig(r=1, targets=["0"], modules_to_save=["classifier"]))
    mark_wire(model, [n for n, p in model.named_parameters() if p.requires_grad])
    return model


def test_to_moe_wire_names():
    model = lora_model()
    assert set(plain_parameters(model)) == {"layer.0.lora_A.default.weight", "layer.0.lora_B.default.weight",
                                            "classifier.weight", "classifier.bias"}
    to_moe(model, num_experts=2, own=1, top_m=2)
    wire = moe_wire_parameters(model)
    assert set(wire) == {"expert0/layer.0.lora_A.default.weight", "expert1/layer.0.lora_A.default.weight",
                         "expert0/layer.0.lora_B.default.weight", "expert1/layer.0.lora_B.default.weight",
                         "cluster1/classifier.weight", "cluster1/classifier.bias",
                         "cluster1/router/layer.0.lora_A.default.weight"}
    layer = model.layer[0]
    assert isinstance(layer, MixtureLoraLayer)
    assert wire["expert1/layer.0.lora_B.default.weight"] is layer.expert_factors("default", 1)[1]
    assert wire["cluster1/router/layer.0.lora_A.default.weight"].shape == (3, 3)   # 2M-1 slots
    assert layer.describe("default")["gate"] == {"kind": "top-k", "slot_experts": [1, 1, 0], "top_k": 2}


def test_client_hooks_convert_once_and_train_own_cluster():
    model = lora_model()
    cfg = {keys.CLUSTER: 0, keys.NUM_EXPERTS: 2, keys.TOP_M: 2, keys.ROUND: 3}
    assert FedLease.model_structure({keys.PHASE: "warmup"}) == {}
    assert FedLease.model_structure(cfg) == {keys.CLUSTER: 0, keys.NUM_EXPERTS: 2, keys.TOP_M: 2}
    FedLease.prepare_model(model, {keys.PHASE: "warmup"})
    assert not is_moe(model)
    FedLease.prepare_model(model, cfg)
    first = model.layer[0]
    FedLease.prepare_model(model, cfg)            # idempotent
    assert model.layer[0] is first
    names = list(FedLease.wire_parameters(model))
    assert sorted(FedLease.train_names(names, {}, cfg)) == [
        "cluster0/classifier.bias", "cluster0/classifier.weight",
        "cluster0/router/layer.0.lora_A.default.weight",
        "expert0/layer.0.lora_A.default.weight", "expert0/layer.0.lora_B.default.weight"]


def fedlease_bert():
    """A tiny BERT, its LoRA version with non-zero factors, and that one as FedLEASE's mixture
    with random routers (so every expert contributes)."""
    base = tiny_bert_cls()
    model = copy.deepcopy(base)
    apply_lora(model, LoraConfig(r=2, alpha=4, targets="all-linear", modules_to_save=[]))
    randomize_trainable(model, seed=3)              # the factors only (the head stays the base's)
    mark_wire(model, [n for n, p in model.named_parameters() if p.requires_grad])
    lora_logits = tiny_logits(model, "bert")
    to_moe(model, num_experts=3, own=2, top_m=3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, mod in adapter_modules(model):
            mod.router("default").weight.copy_(torch.randn(mod.router("default").weight.shape, generator=g))
    return base, model, lora_logits


def test_disable_adapters_on_fedlease_model_gives_base_logits():
    base, model, lora_logits = fedlease_bert()
    want = tiny_logits(base, "bert")
    mixed = tiny_logits(model, "bert")
    assert (mixed - want).abs().max() > 1e-2 and (mixed - lora_logits).abs().max() > 1e-3
    assert len(list(adapter_modules(model))) == 13          # 2 blocks x (q k v o in out) + pooler
    with disable_adapters(model):
        assert torch.allclose(tiny_logits(model, "bert"), want, atol=1e-6)
    assert torch.allclose(tiny_logits(model, "bert"), mixed, atol=0)   # restored


def test_merge_adapters_refuses_fedlease_model():
    _, model, _ = fedlease_bert()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(RankwiseError, match=r"cannot be merged.*export with --format rankwise"):
        merge_adapters(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_eval_model_is_a_converted_copy():
    model = lora_model()
    s = FedLease(FedLeaseConfig(), FederatedConfig(clients=2), {n: p.detach() for n, p in
                 plain_parameters(model).items()}, roles={"layer.0.lora_A.default.weight": "A",
                                                          "layer.0.lora_B.default.weight": "B"})
    assert s.eval_model(model, {}) is model
    view = s.eval_model(model, {keys.CLUSTER: 1, keys.NUM_EXPERTS: 2, keys.TOP_M: 2})
    assert view is not model and is_moe(view) and not is_moe(model)
    assert "cluster1/router/layer.0.lora_A.default.weight" in s.wire_parameters(view)
