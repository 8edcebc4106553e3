"""``moe-lora``: gates (fixed top-k, adaptive top-M by mass), the switch balance loss on
hand-made router outputs, router statistics, the routed formula, and the engine adding the
balance loss."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise.adapters.common.routing import RouterStats, switch_balance_loss
from rankwise.adapters.mixture import (MixtureLoraLayer, MoeLoraConfig, ThresholdGate, TopKGate,
                                       apply_moe_lora)
from rankwise.configs import from_dict
from rankwise.core.protocol import aux_losses, statistics
from rankwise.engine import Engine, get_task
from rankwise.errors import RankwiseError
from rankwise.testing import tiny_batch, tiny_bert_cls


def test_threshold_gate_keeps_fewest_experts_reaching_the_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02], [0.3, 0.3, 0.2, 0.2]])
    logits = probs.log()
    w = ThresholdGate(0.75, max_k=3)(logits)
    # row 0: 0.5 < 0.75 -> keep 2nd (mass before it 0.5), 0.8 >= 0.75 -> stop: experts 0, 1
    # row 1: 0.9 alone; row 2: 0.3, 0.3 (0.6 < 0.75), 0.2 (capped by max_k=3)
    want = torch.tensor([[0.5, 0.3, 0, 0], [0.9, 0, 0, 0], [0.3, 0.3, 0.2, 0]])
    torch.testing.assert_close(w, want, atol=1e-6, rtol=0)
    assert ThresholdGate(1.0, max_k=2)(logits).gt(0).sum(-1).tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="threshold"):
        ThresholdGate(0.0, 2)


def test_switch_balance_loss_on_hand_made_router_outputs():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.5, 0.4, 0.1]])
    top1 = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]])
    # f = (2, 1, 1) / 4, P = mean rows = (0.375, 0.35, 0.275): 3 * (0.1875 + 0.0875 + 0.06875)
    loss = switch_balance_loss(probs, top1, weight=0.01)
    assert abs(float(loss) - 0.01 * 3 * (0.5 * 0.375 + 0.25 * 0.35 + 0.25 * 0.275)) < 1e-7
    uniform = torch.full((6, 4), 0.25)
    top2 = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1]] * 3)
    assert abs(float(switch_balance_loss(uniform, top2, 1.0)) - 2.0) < 1e-6  # = k at balance
    p = probs.clone().requires_grad_(True)
    switch_balance_loss(p, top1, 1.0).backward()                            # only P has a gradient
    torch.testing.assert_close(p.grad, (3 * torch.tensor([0.5, 0.25, 0.25]) / 4).expand(4, 3))


def test_router_stats_counts_per_mode():
    stats = RouterStats(3)
    stats.update(torch.tensor([[0.6, 0.4, 0.0], [0.0, 0.3, 0.7]]), training=True)
    stats.update(torch.tensor([[0.2, 0.3, 0.5]]), training=False)
    d = stats.as_dict()
    assert d["experts"] == 3 and d["train"]["decisions"] == 2 and d["eval"]["decisions"] == 1
    assert d["train"]["selected"] == [0.5, 1.0, 0.5] and d["train"]["top1"] == [0.5, 0.0, 0.5]
    assert d["train"]["load"] == [0.25, 0.5, 0.25]
    torch.testing.assert_close(torch.tensor(d["eval"]["load"]), torch.tensor([0.2, 0.3, 0.5]))  # dense
    stats.reset(("eval",))
    assert "eval" not in stats.as_dict() and "train" in stats.as_dict()


def test_layer_reports_the_formula_on_its_own_router():
    torch.manual_seed(0)
    layer = MixtureLoraLayer(nn.Linear(6, 5))
    mix = layer.add("default", 4, r=2, alpha=4.0, gate=TopKGate(list(range(4)), 2),
                    router_init="kaiming", balance_weight=0.05)
    for e in mix.experts:
        nn.init.normal_(e.lora_B.weight)
    x = torch.randn(3, 7, 6)
    layer.train()
    y = layer(x)
    probs = torch.softmax(x @ mix.router.weight.T, -1)                      # (3, 7, 4)
    top = probs.topk(2, -1)
    w = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
    chosen = torch.zeros_like(probs).scatter(-1, top.indices, 1.0).reshape(-1, 4)
    want = 0.05 * 4 * ((chosen.sum(0) / 21) * probs.reshape(-1, 4).mean(0)).sum()
    assert abs(float(layer.aux_losses()["balance_loss"].detach()) - float(want.detach())) < 1e-6
    delta = sum(w[..., m:m + 1] * (x @ e.lora_A.weight.T @ e.lora_B.weight.T) * 2.0
                for m, e in enumerate(mix.experts))
    torch.testing.assert_close(y, layer.base_layer(x) + delta, atol=1e-5, rtol=0)
    layer.eval()
    layer(x)
    assert layer.aux_losses() == {}                                         # none outside training
    assert statistics(nn.Sequential(layer))["0"]["default"]["train"]["decisions"] == 21


def test_apply_equals_base_at_init_and_adaptive_routing():
    base = tiny_bert_cls()
    model = tiny_bert_cls()
    cfg = MoeLoraConfig(num_experts=4, top_k=3, mass_threshold=0.5, targets=["query", "value"])
    layers = apply_moe_lora(model, cfg)
    assert len(layers) == 4 and all(isinstance(m.mixtures["default"].gate, ThresholdGate) for m in layers.values())
    batch = {k: v for k, v in tiny_batch("bert").items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, base(**batch).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad,match", [({"top_k": 5}, "top_k: got 5, more than num_experts=4"),
                                       ({"num_experts": 0}, "num_experts: got 0"),
                                       ({"mass_threshold": 1.5}, "mass_threshold")])
def test_bad_config_is_one_message(bad, match):
    with pytest.raises(RankwiseError, match=match):
        from_dict(MoeLoraConfig, {"name": "moe-lora", **bad}, "method")


class _Data(list):
    pad_id = 0


def test_engine_adds_the_balance_loss_to_the_objective():
    """One engine step (SGD, lr 1, no clipping) moves every weight by minus the gradient of
    task loss / targets + the layers' balance losses; the step result logs it by name."""
    torch.manual_seed(0)
    model = tiny_bert_cls()
    apply_moe_lora(model, MoeLoraConfig(targets=["query"], balance_weight=0.5))
    batch = tiny_batch("bert", batch=4)
    data = _Data({"input_ids": batch["input_ids"][i].tolist(), "label": int(batch["labels"][i])}
                 for i in range(4))
    task = get_task("classification")
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    model.train()
    collated = task.collate(list(data), 0)
    loss_sum, _ = task.loss_sum(model, collated)
    extra = aux_losses(model)
    assert set(extra) == {"balance_loss"}
    grads = torch.autograd.grad(loss_sum / 4 + extra["balance_loss"], params, allow_unused=True)
    engine = Engine(model, task, torch.optim.SGD(params, lr=1.0), data, batch_size=4)
    result = engine.train_step(0)
    assert abs(result.aux["balance_loss"] - float(extra["balance_loss"])) < 1e-6
    for p, b, g in zip(params, before, grads):
        torch.testing.assert_close(p.detach(), b - (g if g is not None else 0), atol=1e-6, rtol=0)
