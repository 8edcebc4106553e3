"""Adapter operations: merge parity, unmerge, disable, named adapters, delete, state dicts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise.adapters.lora import LoraConfig, LoraLayer, apply_lora
from rankwise.core import (
    adapter_modules, adapter_state_dict, count_parameters, delete_adapter, disable_adapters,
    load_adapter_state_dict, merge_adapters, merge_and_unload, set_adapter, unmerge_adapters,
)
from rankwise.core.ops import adapter_names
from rankwise.errors import RankwiseError
from rankwise.testing import tiny_batch, tiny_bert_cls, tiny_gpt2_lm, tiny_llama_lm

BUILDERS = {"bert": tiny_bert_cls, "gpt2": tiny_gpt2_lm, "llama": tiny_llama_lm}


def _randomize(model, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _logits(model, kind):
    batch = {k: v for k, v in tiny_batch(kind).items() if k != "labels"}
    with torch.no_grad():
        return model(**batch).logits


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_merge_parity_and_exact_unmerge(kind):
    model = BUILDERS[kind]()
    apply_lora(model, LoraConfig(r=4, alpha=8, targets="all-linear"))
    _randomize(model)
    weights = {k: v.clone() for k, v in model.state_dict().items() if "base_layer" in k}
    adapted = _logits(model, kind)
    merge_adapters(model)
    torch.testing.assert_close(_logits(model, kind), adapted, atol=1e-5, rtol=0)
    merge_adapters(model)  # merging twice is a no-op
    torch.testing.assert_close(_logits(model, kind), adapted, atol=1e-5, rtol=0)
    unmerge_adapters(model)
    for k, w in model.state_dict().items():
        if k in weights:
            torch.testing.assert_close(w, weights[k], atol=1e-6, rtol=0)
    torch.testing.assert_close(_logits(model, kind), adapted, atol=1e-5, rtol=0)


def test_disable_context_gives_base_output():
    base = tiny_gpt2_lm()
    expected_base = _logits(base, "gpt2")
    model = tiny_gpt2_lm()
    apply_lora(model, LoraConfig(r=4, targets=["c_attn"]))
    _randomize(model)
    adapted = _logits(model, "gpt2")
    merge_adapters(model)  # disabling also undoes a merge
    with disable_adapters(model):
        torch.testing.assert_close(_logits(model, "gpt2"), expected_base, atol=1e-5, rtol=0)
    torch.testing.assert_close(_logits(model, "gpt2"), adapted, atol=1e-5, rtol=0)


def test_named_adapters_switch_and_delete():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    base_out = model(x)
    apply_lora(model, LoraConfig(r=2, alpha=2, targets=["0", "2"]), "a")
    apply_lora(model, LoraConfig(r=3, alpha=6, targets=["0"]), "b")
    assert adapter_names(model) == ["a", "b"]
    assert len(list(adapter_modules(model))) == 2  # "b" joined the existing layer, no nesting
    _randomize(model, scale=1.0)  # only "b" trains after the second apply
    for p in model[0].lora_A["a"].parameters():
        p.data.normal_()
    for p in model[0].lora_B["a"].parameters():
        p.data.normal_()
    l0 = model[0]

    def manual(names0, names2):
        h = l0.base_layer(x)
        for n in names0:
            h = h + l0.scaling[n] * x @ l0.lora_A[n].weight.T @ l0.lora_B[n].weight.T
        h = torch.relu(h)
        y = model[2].base_layer(h)
        for n in names2:
            y = y + model[2].scaling[n] * h @ model[2].lora_A[n].weight.T @ model[2].lora_B[n].weight.T
        return y

    with torch.no_grad():
        torch.testing.assert_close(model(x), manual(["a", "b"], ["a"]), atol=1e-5, rtol=0)
        set_adapter(model, "b")
        torch.testing.assert_close(model(x), manual(["b"], []), atol=1e-5, rtol=0)
        set_adapter(model, "a")
        torch.testing.assert_close(model(x), manual(["a"], ["a"]), atol=1e-5, rtol=0)
        with pytest.raises(RankwiseError, match="no adapter named 'c'"):
            set_adapter(model, "c")
        merge_adapters(model, "a")
        delete_adapter(model, "a")  # a merged adapter is unmerged before deletion
        assert adapter_names(model) == ["b"]
        torch.testing.assert_close(model(x), base_out, atol=1e-5, rtol=0)  # "b" is inactive
        set_adapter(model, "b")
        torch.testing.assert_close(model(x), manual(["b"], []), atol=1e-5, rtol=0)


def test_trainable_counts_and_state_dict_round_trip():
    model = tiny_bert_cls()
    apply_lora(model, LoraConfig(r=2, targets=["query"]))
    trainable, total = count_parameters(model)
    assert trainable == 2 * (2 * 16 + 16 * 2) + (16 * 3 + 3)  # two layers of A, B + head
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        *(f"bert.encoder.layer.{i}.attention.self.query.lora_{m}.default.weight"
          for i in (0, 1) for m in "AB"), "classifier.weight", "classifier.bias"}
    _randomize(model)
    state = {k: v.clone() for k, v in adapter_state_dict(model).items()}
    assert "bert.encoder.layer.0.attention.self.query.lora_A.weight" in state
    assert "classifier.weight" in state and len(state) == 6
    other = tiny_bert_cls()
    apply_lora(other, LoraConfig(r=2, targets=["query"]))
    load_adapter_state_dict(other, state)
    torch.testing.assert_close(_logits(other, "bert"), _logits(model, "bert"), atol=0, rtol=0)
    with pytest.raises(RankwiseError, match="missing"):
        load_adapter_state_dict(other, {k: v for k, v in state.items() if "layer.0" not in k})
    bad = dict(state)
    bad["classifier.bias"] = torch.zeros(5)
    with pytest.raises(RankwiseError, match="shape"):
        load_adapter_state_dict(other, bad)


def test_merge_and_unload_returns_plain_model():
    model = tiny_llama_lm()
    apply_lora(model, LoraConfig(r=2, targets=["q_proj", "down_proj"]))
    _randomize(model)
    adapted = _logits(model, "llama")
    plain = merge_and_unload(model)
    assert not any(isinstance(m, LoraLayer) for m in plain.modules())
    assert not any("lora" in k or "base_layer" in k for k in plain.state_dict())
    torch.testing.assert_close(_logits(plain, "llama"), adapted, atol=1e-5, rtol=0)
