"""Mixture of LoRA experts: the routed formula, the gate, the AdapterModule protocol, and the
conversion of factorized models (LoRA, GoRA, GPT-2's Conv1D) through the protocol."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from rankwise.adapters.gora import GoraConfig, apply_gora
from rankwise.adapters.lora import LoraConfig, LoraLayer, apply_lora
from rankwise.adapters.mixture import MixtureLoraLayer, TopKGate, factorized_to_mixture, own_expert_slots
from rankwise.core import adapter_state_dict, delete_adapter, disable_adapters, merge_adapters
from rankwise.core.protocol import AdapterModule, adapter_modules, describe, factors, is_mergeable
from rankwise.errors import RankwiseError
from rankwise.testing import randomize_trainable, tiny_batch, tiny_bert_cls, tiny_gpt2_lm, tiny_logits


def mixture(num_experts=2, own=1, top_k=2, seed=0) -> MixtureLoraLayer:
    torch.manual_seed(seed)
    layer = MixtureLoraLayer(nn.Linear(3, 2, bias=False))
    mix = layer.add("default", num_experts, r=1, alpha=2.0, gate=TopKGate(own_expert_slots(num_experts, own), top_k))
    for e in mix.experts:
        nn.init.normal_(e.lora_B.weight)
    return layer


def test_own_expert_slots_and_gate_weights():
    assert own_expert_slots(3, 1) == [1, 1, 1, 0, 2]
    gate = TopKGate([1, 1, 0], top_k=2)
    logits = torch.tensor([[0.0, 1.0, 5.0], [3.0, 2.0, 0.0]])
    p = torch.softmax(logits, -1)
    # row 0: top-2 = slots 2 (expert 0) and 1 (expert 1); row 1: slots 0 and 1 (both expert 1)
    want = torch.tensor([[p[0, 2], p[0, 1]], [0.0, p[1, 0] + p[1, 1]]])
    assert torch.allclose(gate(logits), want, atol=1e-7)
    with pytest.raises(ValueError, match="own expert"):
        own_expert_slots(2, 2)


def test_routed_formula():
    layer = mixture()
    x = torch.randn(5, 3)
    base = layer.base_layer(x)

    def delta(m):
        a, b = layer.expert_factors("default", m)
        return x @ a.T @ b.T * 2.0                      # s = alpha / r = 2

    # zero router: uniform over 3 slots; the top-2 tie keeps slots 0 and 1, both the own expert
    assert torch.allclose(layer(x), base + (2 / 3) * delta(1), atol=1e-6)
    with torch.no_grad():
        layer.router("default").weight.copy_(torch.tensor([[0.0, 0, 0], [0, 0, 0], [5.0, 0, 0]]))
    probs = torch.softmax(x @ layer.router("default").weight.T, -1)          # (5, 3)
    top = probs.topk(2, -1).indices
    kept = torch.zeros_like(probs).scatter(-1, top, probs.gather(-1, top))
    w_other, w_own = kept[:, 2:3], kept[:, 0:1] + kept[:, 1:2]                # slot 2 -> expert 0
    assert torch.allclose(layer(x), base + w_own * delta(1) + w_other * delta(0), atol=1e-6)


def test_protocol_disable_merge_describe_delete():
    layer = mixture(num_experts=3, own=0, top_k=3)
    with torch.no_grad():
        layer.router("default").weight.normal_()
    assert isinstance(layer, AdapterModule) and not is_mergeable(layer)
    assert layer.adapter_names() == ["default"] and factors(layer, "default") is None
    keys = sorted(layer.adapter_params("default"))
    assert keys == sorted([f"experts.{m}.lora_{f}.weight" for m in range(3) for f in "AB"] + ["router.weight"])
    info = describe(layer, "default")
    assert json.loads(json.dumps(info)) == {"num_experts": 3, "r": 1, "alpha": 2.0, "use_rslora": False,
                                            "slots": 5, "gate": {"kind": "top-k", "slot_experts": [0, 0, 0, 1, 2],
                                                                 "top_k": 3}}
    model = nn.Sequential(layer)
    x = torch.randn(4, 3)
    routed = model(x)
    assert (routed - layer.base_layer(x)).abs().max() > 1e-3
    with disable_adapters(model):
        assert torch.equal(model(x), layer.base_layer(x))
    assert torch.equal(model(x), routed)
    w = layer.base_layer.weight.clone()
    with pytest.raises(RankwiseError, match="cannot be merged"):
        merge_adapters(model)
    with pytest.raises(RankwiseError, match="cannot be merged"):
        layer.merge("default")
    assert torch.equal(layer.base_layer.weight, w)
    assert len(adapter_state_dict(model)) == 7
    delete_adapter(model, "default")
    assert layer.adapter_names() == [] and torch.equal(model(x), layer.base_layer(x))


def one_hot_gate(m: int):
    """A gate that gives expert ``m`` weight 1 (the mixture then equals that expert's LoRA)."""
    def gate(logits: torch.Tensor) -> torch.Tensor:
        w = torch.zeros(*logits.shape[:-1], 2)
        w[..., m] = 1.0
        return w
    return gate


@pytest.mark.parametrize("kind", ["lora-bert", "gora-bert", "lora-gpt2"])
def test_conversion_copies_each_factorized_layer(kind):
    name = kind.split("-")[1]
    model = tiny_bert_cls() if name == "bert" else tiny_gpt2_lm()
    if kind.startswith("gora"):
        apply_gora(model, GoraConfig(r=4, r_min=1, r_max=8, alpha=8.0, use_rslora=True, n_batches=2),
                   batches=[tiny_batch("bert", seed=i) for i in range(2)])
    else:
        apply_lora(model, LoraConfig(r=2, alpha=6, targets="all-linear", modules_to_save=[]))
    randomize_trainable(model, seed=4, std=0.2)
    ranks = {p: m.ranks["default"] for p, m in adapter_modules(model) if isinstance(m, LoraLayer)}
    want = tiny_logits(model, name)
    plain = copy.deepcopy(model)
    with disable_adapters(plain):
        base = tiny_logits(plain, name)
    layers = factorized_to_mixture(model, 2, lambda: one_hot_gate(1))
    assert set(layers) == set(ranks) and not any(isinstance(m, LoraLayer) for m in model.modules())
    assert {p: describe(m, "default")["r"] for p, m in layers.items()} == ranks
    assert torch.allclose(tiny_logits(model, name), want, atol=1e-5)   # expert 1 = the old LoRA
    with disable_adapters(model):
        assert torch.allclose(tiny_logits(model, name), base, atol=1e-6)
    with pytest.raises(RankwiseError, match="export with --format rankwise"):
        merge_adapters(model)


def test_conversion_needs_factors():
    with pytest.raises(RankwiseError, match="method.name: lora or gora"):
        factorized_to_mixture(tiny_bert_cls(), 2, lambda: TopKGate([0, 1], 2))
