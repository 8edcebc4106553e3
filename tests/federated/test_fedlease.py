"""FedLEASE: clustering of constructed client adapters, expert initialisation, per-cluster
averaging, and the adaptive top-M MoE layer."""
from __future__ import annotations

import torch
from torch import nn

from rankwise.federated import keys
from rankwise.federated.config import FederatedConfig
from rankwise.federated.moe import MoeLoraLayer, to_moe, wire_parameters
from rankwise.federated.strategies.fedlease import (FedLease, FedLeaseConfig, b_distance,
                                                    cluster_clients, silhouette)

from fed_helpers import FakeGrid, config_of, received, reply

A0 = "m.layer.0.q.lora_A.default.weight"
B0 = "m.layer.0.q.lora_B.default.weight"
A1 = "m.layer.1.q.lora_A.default.weight"
B1 = "m.layer.1.q.lora_B.default.weight"


def client_adapter(direction: torch.Tensor, scale: float, a: float) -> dict:
    """Two layers whose B matrices point along ``direction`` (the client's task)."""
    b = (direction * scale).reshape(4, 1)
    return {A0: torch.full((1, 3), a), B0: b, A1: torch.full((1, 3), a), B1: b.clone()}


def test_distance_silhouette_and_clustering_on_two_task_groups():
    e1, e2 = torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 1.0, 0, 0])
    tilt = torch.tensor([0, 0, 0.1, 0])
    states = [client_adapter(e1, 1, 0), client_adapter(e1 + tilt, 2, 0), client_adapter(e2, 1, 0),
              client_adapter(e2 + tilt, 3, 0), client_adapter(e1, 5, 0)]
    d = b_distance(states)
    assert torch.allclose(d[0, 4], torch.tensor(0.0, dtype=torch.float64))   # scale does not matter
    assert torch.allclose(d[0, 2], torch.tensor(1.0, dtype=torch.float64))   # orthogonal tasks
    labels, scores = cluster_clients(d, max_k=4)
    assert labels == [0, 0, 1, 1, 0]
    assert max(scores, key=scores.get) == 2 and scores[2] > 0.9
    assert silhouette(d, [0, 1, 0, 1, 0]) < 0


def test_warmup_clustering_builds_experts_and_averages_within_clusters():
    e1, e2 = torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 1.0, 0, 0])
    init = {A0: torch.zeros(1, 3), B0: torch.zeros(4, 1), A1: torch.zeros(1, 3), B1: torch.zeros(4, 1),
            "classifier.weight": torch.zeros(2, 3)}
    adapters = {1: client_adapter(e1, 1, 1.0), 2: client_adapter(e1, 3, 3.0),
                3: client_adapter(e2, 1, 5.0), 4: client_adapter(e2, 2, 7.0)}
    for n, st in adapters.items():
        st["classifier.weight"] = torch.full((2, 3), float(n))
    s = FedLease(FedLeaseConfig(max_experts=3), FederatedConfig(clients=4, min_clients=2), init)
    grid = FakeGrid([1, 2, 3, 4])
    from flwr.app import ConfigRecord
    msgs = list(s.configure_train(1, None, ConfigRecord(), grid))
    assert {config_of(m)[keys.PHASE] for m in msgs} == {"warmup"}
    s.aggregate_train(1, [reply(m, adapters[m.metadata.dst_node_id]) for m in msgs])
    assert s.num_experts == 2 and s.cluster == {1: 0, 2: 0, 3: 1, 4: 1}
    assert torch.allclose(s.global_state["expert0/" + A0], torch.full((1, 3), 2.0))   # mean of 1 and 3
    assert torch.allclose(s.global_state["expert1/" + B0], (e2 * 1.5).reshape(4, 1))
    assert torch.allclose(s.global_state["cluster1/classifier.weight"], torch.full((2, 3), 3.5))
    assert s.global_state["cluster0/m.layer.0.q.router.weight"].shape == (3, 3)     # (2M-1, d_in)
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


def test_moe_layer_top_m_mixture_formula():
    from rankwise.adapters.lora import LoraLayer
    torch.manual_seed(0)
    layer = LoraLayer(nn.Linear(3, 2, bias=False))
    for m in range(2):
        layer.add(f"e{m}", r=1, alpha=1.0)
        nn.init.normal_(layer.lora_B[f"e{m}"].weight)
    moe = MoeLoraLayer(layer, num_experts=2, own=1, top_m=2)
    x = torch.randn(5, 3)
    # zero router: uniform over 3 slots; top-2 ties keep slots 0 and 1, both own expert (e1)
    delta = lambda m: layer.lora_B[f"e{m}"](layer.lora_A[f"e{m}"](x))
    assert torch.allclose(moe(x), layer.base_layer(x) + (2 / 3) * delta(1), atol=1e-6)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[0.0, 0, 0], [0, 0, 0], [5.0, 0, 0]]))
    w = moe.expert_weights(x)
    probs = torch.softmax(moe.router(x), -1)
    top = probs.topk(2, -1).indices
    for i in range(5):   # slot 2 maps to the other expert (e0)
        own = sum(float(probs[i, j].detach()) for j in top[i].tolist() if j < 2)
        other = float(probs[i, 2].detach()) if 2 in top[i].tolist() else 0.0
        assert torch.allclose(w[i], torch.tensor([other, own]), atol=1e-6)


def test_to_moe_wire_names():
    from rankwise.adapters.lora import LoraConfig, apply_lora
    model = nn.Sequential()
    model.add_module("layer", nn.ModuleList([nn.Linear(3, 3)]))
    model.add_module("classifier", nn.Linear(3, 2))
    apply_lora(model, LoraConfig(r=1, targets=["0"], modules_to_save=["classifier"]))
    plain = wire_parameters(model)
    assert set(plain) == {"layer.0.lora_A.default.weight", "layer.0.lora_B.default.weight",
                          "classifier.weight", "classifier.bias"}
    to_moe(model, num_experts=2, own=1, top_m=2)
    wire = wire_parameters(model)
    assert set(wire) == {"expert0/layer.0.lora_A.default.weight", "expert1/layer.0.lora_A.default.weight",
                         "expert0/layer.0.lora_B.default.weight", "expert1/layer.0.lora_B.default.weight",
                         "cluster1/classifier.weight", "cluster1/classifier.bias",
                         "cluster1/layer.0.router.weight"}
