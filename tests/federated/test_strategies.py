"""Aggregation of every strategy on hand-computed small tensors, through the Flower API
(``configure_train`` / ``aggregate_train``) with a fake Grid: no Ray, no model."""
from __future__ import annotations

import math

import pytest
import torch

from rankwise.federated import keys
from rankwise.federated.config import FederatedConfig
from rankwise.federated.strategies import FedIt, FfaLora, Leff, RoLora, Yoco
from rankwise.federated.strategies.leff import LeffConfig, block_probabilities
from rankwise.federated.strategies.lora_avg import FedItConfig, FfaLoraConfig, RoLoraConfig
from rankwise.federated.strategies.yoco import YocoConfig, pca_aggregate

from fed_helpers import FakeGrid, config_of, error_reply, lora_roles, lora_state, received, reply

A = "m.layer.0.q.lora_A.default.weight"
B = "m.layer.0.q.lora_B.default.weight"
ROLES = {A: "A", B: "B"}


def run_round(strategy, rnd, grid, make_state, n=None):
    """Send a round's plans, answer with ``make_state(node, msg)``, aggregate."""
    from flwr.app import ConfigRecord
    msgs = list(strategy.configure_train(rnd, None, ConfigRecord(), grid))
    replies = []
    for m in msgs:
        out = make_state(m.metadata.dst_node_id, m)
        if out is not None:
            replies.append(out if not isinstance(out, dict) else reply(m, out, (n or {}).get(m.metadata.dst_node_id, 10)))
    strategy.aggregate_train(rnd, replies)
    return msgs


def test_fedit_product_has_cross_terms_rolora_is_exact():
    init = {A: torch.tensor([[1.0, 1.0]]), B: torch.zeros(2, 1)}       # A: (r=1, in=2), B: (out=2, r=1)
    a_i = {1: torch.tensor([[1.0, 0.0]]), 2: torch.tensor([[0.0, 1.0]])}
    b_i = {1: torch.tensor([[1.0], [0.0]]), 2: torch.tensor([[0.0], [3.0]])}
    fed = FederatedConfig(clients=2, min_clients=2)
    grid = FakeGrid([1, 2])
    fedit = FedIt(FedItConfig(), fed, init, roles=ROLES)
    run_round(fedit, 1, grid, lambda n, m: {A: a_i[n], B: b_i[n]})
    product = fedit.global_state[B] @ fedit.global_state[A]
    wanted = (b_i[1] @ a_i[1] + b_i[2] @ a_i[2]) / 2          # [[0.5, 0], [0, 1.5]]
    assert torch.allclose(product, torch.tensor([[0.25, 0.25], [0.75, 0.75]]))  # cross terms
    assert not torch.allclose(product, wanted)
    ro = RoLora(RoLoraConfig(), fed, init, roles=ROLES)
    msgs = run_round(ro, 1, grid, lambda n, m: {B: b_i[n]})      # round 1 trains B only
    assert {config_of(m)[keys.TRAIN_FACTORS] for m in msgs} == {"B"}
    a0 = init[A]
    assert torch.equal(ro.global_state[A], a0)
    exact = (b_i[1] @ a0 + b_i[2] @ a0) / 2
    assert torch.allclose(ro.global_state[B] @ ro.global_state[A], exact, atol=0)
    msgs = run_round(ro, 2, grid, lambda n, m: {A: a_i[n]})      # round 2 trains A only
    assert {config_of(m)[keys.TRAIN_FACTORS] for m in msgs} == {"A"}
    assert all(set(received(m)) == {B} for m in msgs)            # only the new B goes down
    b_new = ro.global_state[B]
    assert torch.allclose(b_new @ ro.global_state[A], (b_new @ a_i[1] + b_new @ a_i[2]) / 2)


def test_ffa_keeps_a_and_averages_b_weighted():
    init = {A: torch.tensor([[2.0, -1.0]]), B: torch.zeros(2, 1)}
    ffa = FfaLora(FfaLoraConfig(), FederatedConfig(clients=2, min_clients=2), init, roles=ROLES)
    b_i = {1: torch.tensor([[1.0], [1.0]]), 2: torch.tensor([[4.0], [-2.0]])}
    msgs = run_round(ffa, 1, FakeGrid([1, 2]), lambda n, m: {B: b_i[n]}, n={1: 30, 2: 10})
    assert all(config_of(m)[keys.TRAIN_FACTORS] == "B" for m in msgs)
    assert torch.equal(ffa.global_state[A], init[A])
    assert torch.allclose(ffa.global_state[B], torch.tensor([[1.75], [0.25]]))  # (30*b1 + 10*b2)/40


def test_rolora_bytes_per_round_are_half_of_fedit():
    init = lora_state(0, layers=4, d=64, r=8)
    fed = FederatedConfig(clients=3, min_clients=2)
    grid = FakeGrid([1, 2, 3])
    per_round = {}
    for cls, cfg in ((FedIt, FedItConfig()), (RoLora, RoLoraConfig())):
        s = cls(cfg, fed, init, roles=lora_roles(4))
        for rnd in (1, 2, 3):
            run_round(s, rnd, grid, lambda n, m, s=s: {k: s.global_state[k] + n for k in s._expected[n]})
        per_round[cls.name] = [h["bytes_up"] + h["bytes_down"] for h in s.history]
    assert per_round["fedit"][0] > 3 * 2 * 8 * 64 * 4 * 4    # 3 clients x A and B x 4 layers, float32
    for rnd in (1, 2):  # round 1: up only (the seed init is not sent); then up + down
        ratio = per_round["rolora"][rnd] / per_round["fedit"][rnd]
        assert abs(ratio - 0.5) < 0.02, (rnd, ratio)


def test_malformed_failed_and_missing_updates_are_not_averaged(caplog):
    init = {A: torch.zeros(1, 2), B: torch.zeros(2, 1)}
    s = FedIt(FedItConfig(), FederatedConfig(clients=5, min_clients=2), init, roles=ROLES)
    good = {A: torch.ones(1, 2), B: torch.ones(2, 1)}

    def answer(node, msg):
        if node == 1 or node == 2:
            return {A: good[A] * node, B: good[B] * node}
        if node == 3:
            return {A: torch.full((1, 2), float("nan")), B: good[B]}
        if node == 4:
            return {A: torch.ones(2, 2), B: good[B]}      # wrong shape
        if node == 5:
            return error_reply(msg, "ClientApp raised")
        return None

    with caplog.at_level("WARNING", logger="rankwise.federated"):
        run_round(s, 1, FakeGrid([1, 2, 3, 4, 5, 6]), answer)
    h = s.history[-1]
    assert h["rejected"] == [3, 4] and h["failed"] == [5] and h["missing"] == [6]
    assert h["aggregated"] == 2
    assert torch.allclose(s.global_state[A], torch.full((1, 2), 1.5))
    assert "node 3 (partition 2)" in caplog.text and "NaN" in caplog.text
    assert "node 6 (partition 5) sent no reply" in caplog.text  # partitions known from identify


def test_round_with_too_few_valid_updates_keeps_global():
    init = {A: torch.zeros(1, 2), B: torch.zeros(2, 1)}
    s = FedIt(FedItConfig(), FederatedConfig(clients=3, min_clients=2), init, roles=ROLES)
    run_round(s, 1, FakeGrid([1, 2]), lambda n, m: {A: torch.ones(1, 2)} if n == 1 else error_reply(m))
    assert s.history[-1]["aggregated"] == 0 and torch.equal(s.global_state[A], init[A])


def test_resync_after_lost_state_sends_everything():
    init = {A: torch.zeros(1, 2), B: torch.zeros(2, 1)}
    s = FedIt(FedItConfig(), FederatedConfig(clients=2, min_clients=1), init, roles=ROLES)
    grid = FakeGrid([1, 2])
    run_round(s, 1, grid, lambda n, m: {A: torch.ones(1, 2) * n, B: torch.ones(2, 1)})
    run_round(s, 2, grid, lambda n, m: error_reply(m, keys.RESYNC_REASON) if n == 2 else
              {A: torch.ones(1, 2), B: torch.ones(2, 1)})
    msgs = run_round(s, 3, grid, lambda n, m: {A: torch.ones(1, 2), B: torch.ones(2, 1)})
    by_node = {m.metadata.dst_node_id: m for m in msgs}
    assert config_of(by_node[2])[keys.FULL_SYNC] is True and set(received(by_node[2])) == {A, B}
    assert config_of(by_node[1])[keys.FULL_SYNC] is False


def test_leff_averages_each_layer_over_its_trainers():
    l0a, l1a = "m.layer.0.q.lora_A.default.weight", "m.layer.1.q.lora_A.default.weight"
    init = {l0a: torch.zeros(1, 2), l1a: torch.zeros(1, 2), "classifier.weight": torch.zeros(1, 2)}
    s = Leff(LeffConfig(capacities=[1]), FederatedConfig(clients=3, min_clients=2), init,
             roles={l0a: "A", l1a: "A"})
    s.capacity = {1: 1, 2: 1, 3: 2}
    s.importance = {1: [1.0, 0.0], 2: [1.0, 0.0], 3: [1.0, 1.0]}
    s.config.temperature = 1e-3  # nodes 1 and 2 pick layer 0 deterministically (p ~ 1 - e^-1000)
    msgs = run_round(s, 1, FakeGrid([1, 2, 3]), lambda n, m: {k: torch.full((1, 2), float(n))
                                                              for k in s._expected[n]}, n={1: 10, 2: 30, 3: 10})
    assert [config_of(m)[keys.TRAIN_LAYERS] for m in msgs] == [[0], [0], [0, 1]]
    assert torch.allclose(s.global_state[l0a], torch.full((1, 2), (10 * 1 + 30 * 2 + 10 * 3) / 50))
    assert torch.allclose(s.global_state[l1a], torch.full((1, 2), 3.0))   # only node 3 trained it
    assert torch.allclose(s.global_state["classifier.weight"], torch.full((1, 2), 2.0))
    # the log: each client's block and the distribution it was drawn from (softmax(block sum / T))
    logged = list(s.history[-1]["block_probabilities"].values())
    assert logged[:2] == [pytest.approx([1.0, 0.0], abs=1e-6)] * 2 and logged[2] == [1.0]
    assert list(s.history[-1]["blocks"].values()) == [[0], [0], [0, 1]]
    assert all(config_of(m)[keys.REFRESH] is True for m in msgs)


def test_leff_logs_block_probabilities_and_can_skip_the_per_round_importance_pass(monkeypatch):
    """``block_probabilities`` in the round log equal block_probabilities(importance, capacity);
    with ``refresh: false`` the plans tell clients not to rerun the full backward."""
    import rankwise.federated.strategies.leff as leff_mod
    l0a, l1a, l2a = (f"m.layer.{i}.q.lora_A.default.weight" for i in range(3))
    init = {l0a: torch.zeros(1, 2), l1a: torch.zeros(1, 2), l2a: torch.zeros(1, 2)}
    s = Leff(LeffConfig(capacities=[1], refresh=False), FederatedConfig(clients=2, min_clients=2), init,
             roles={l0a: "A", l1a: "A", l2a: "A"})
    s.capacity = {1: 1, 2: 2}
    s.importance = {1: [1.62, 1.50, 2.30], 2: [0.2, 0.1, 0.4]}
    msgs = run_round(s, 1, FakeGrid([1, 2]), lambda n, m: {k: torch.ones(1, 2) for k in s._expected[n]})
    logged = list(s.history[-1]["block_probabilities"].values())
    z1 = sum(math.exp(v) for v in (1.62, 1.50, 2.30))
    assert logged[0] == pytest.approx([math.exp(v) / z1 for v in (1.62, 1.50, 2.30)], abs=1e-6)
    z2 = math.exp(0.3) + math.exp(0.5)
    assert logged[1] == pytest.approx([math.exp(0.3) / z2, math.exp(0.5) / z2], abs=1e-6)
    assert all(config_of(m)[keys.REFRESH] is False for m in msgs)
    monkeypatch.setattr(leff_mod, "client_importance", lambda c: [1.0])
    assert Leff.pre_train_metrics(object(), {keys.TRAIN_LAYERS: [0], keys.REFRESH: False}) == {}
    got = Leff.pre_train_metrics(object(), {keys.TRAIN_LAYERS: [0], keys.REFRESH: True})
    assert got[keys.IMPORTANCE] == [1.0] and got[keys.IMPORTANCE_S] >= 0.0


def test_block_probabilities_are_the_papers_softmax_of_block_importance():
    """LEFF stage 2: p(block) = softmax(sum of its layers' importances), no normalisation."""
    imp = [0.3, 1.2, 0.5, 2.0]
    p = block_probabilities(imp, capacity=2)
    scores = [1.5, 1.7, 2.5]
    z = sum(math.exp(v) for v in scores)
    assert all(math.isclose(a, math.exp(v) / z, rel_tol=1e-12) for a, v in zip(p, scores))
    p = block_probabilities([3.0, 1.0], capacity=1, temperature=0.5)   # scores 3/0.5, 1/0.5
    assert math.isclose(p[0], 1 / (1 + math.exp(-4.0)))
    p = block_probabilities([3.0, 1.0], capacity=1, normalize=True)    # the old reading, opt-in
    assert math.isclose(p[0], 1 / (1 + math.exp(-0.5)))


def test_leff_importance_is_measured_on_the_received_global_model(monkeypatch):
    """The importance a LEFF client reports is |g * theta| of the model it received, not of
    the model its local training produced (the ClientApp calls pre_train_metrics before
    training and client_metrics after)."""
    import rankwise.federated.strategies.leff as leff_mod

    class Client:  # what the hooks see of a ClientApp client
        state = "received"

    seen = []
    monkeypatch.setattr(leff_mod, "client_importance", lambda c: seen.append(c.state) or [1.0])
    c = Client()
    before = leff_mod.Leff.pre_train_metrics(c, {keys.TRAIN_LAYERS: [0]})
    c.state = "trained"
    after = leff_mod.Leff.client_metrics(c, {keys.TRAIN_LAYERS: [0]})
    assert seen == ["received"] and before[keys.IMPORTANCE] == [1.0] and after == {}


def test_yoco_is_one_shot_and_aggregates_a_by_principal_components():
    init = {A: torch.zeros(1, 3), B: torch.zeros(2, 1)}
    s = Yoco(YocoConfig(pca_components=1), FederatedConfig(clients=3, min_clients=2, rounds=4, local_steps=5), init,
             roles=ROLES)
    assert s.num_rounds(4) == 1
    a_i = {1: torch.tensor([[1.0, 0.0, 0.0]]), 2: torch.tensor([[1.0, 0.0, 0.0]]), 3: torch.tensor([[0.0, 1.0, 0.0]])}
    msgs = run_round(s, 1, FakeGrid([1, 2, 3]), lambda n, m: {A: a_i[n], B: torch.ones(2, 1) * n})
    cfg = config_of(msgs[0])
    assert cfg[keys.PHASE] == "oneshot" and cfg[keys.TRAIN_STEPS] == 20
    # top principal direction of the uncentred stack is e1: A_g = mean projection = (2/3) e1
    assert torch.allclose(s.global_state[A], torch.tensor([[2 / 3, 0.0, 0.0]]), atol=1e-6)
    assert torch.allclose(s.global_state[B], torch.full((2, 1), 2.0))


def test_pca_aggregate_with_all_components_is_weighted_mean():
    mats = [torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    w = [1.0, 2.0, 3.0]
    mean = sum(wi * m for wi, m in zip(w, mats)) / 6
    assert torch.allclose(pca_aggregate(mats, w, k=3), mean, atol=1e-5)


def test_ffa_selects_factors_by_roles_not_names():
    down, up = "m.layer.0.q.down", "m.layer.0.q.up"        # no "lora_" in the names
    init = {down: torch.ones(1, 2), up: torch.zeros(2, 1), "m.layer.0.q.lora_A.extra": torch.zeros(1)}
    ffa = FfaLora(FfaLoraConfig(), FederatedConfig(clients=2, min_clients=2), init, roles={down: "A", up: "B"})
    msgs = run_round(ffa, 1, FakeGrid([1, 2]), lambda n, m: {k: init[k] + n for k in ffa._expected[n]})
    assert set(ffa._expected[1]) == {up, "m.layer.0.q.lora_A.extra"}
    assert torch.equal(ffa.global_state[down], init[down]) and len(msgs) == 2
    assert torch.allclose(ffa.global_state[up], torch.full((2, 1), 1.5))
    with pytest.raises(ValueError, match="roles"):
        FfaLora(FfaLoraConfig(), FederatedConfig(clients=2), init)


@pytest.mark.parametrize("name,needs", [("fedit", False), ("ffa-lora", True), ("rolora", True),
                                        ("fedlease", True), ("yoco", True), ("leff", False)])
def test_registered(name, needs):
    from rankwise import registry
    entry = registry.get("strategy", name)
    assert entry.builder.name == name and entry.config_cls().name == name
    assert entry.builder.needs_factors is needs
