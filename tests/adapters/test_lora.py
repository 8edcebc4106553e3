"""LoRA layer against explicit formulas: scale, rsLoRA, Conv1D, gradients, ranks, patterns, init."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from rankwise.adapters.common.factors import lora_scale
from rankwise.adapters.lora import LoraConfig, LoraLayer, apply_lora
from rankwise.configs import from_dict
from rankwise.errors import RankwiseError
from rankwise.testing import tiny_bert_cls, tiny_gpt2_lm


def _filled(layer: LoraLayer, name: str = "default", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
    with torch.no_grad():
        a.copy_(torch.randn(a.shape, generator=g))
        b.copy_(torch.randn(b.shape, generator=g))
    return a.detach().clone(), b.detach().clone()


@pytest.mark.parametrize("rslora", [False, True])
def test_linear_output_and_grads_match_formula(rslora):
    torch.manual_seed(0)
    base = nn.Linear(8, 6)
    layer = LoraLayer(base)
    layer.add("default", r=3, alpha=5.0, use_rslora=rslora)
    a, b = _filled(layer)
    s = 5.0 / math.sqrt(3) if rslora else 5.0 / 3
    assert layer.scaling["default"] == pytest.approx(s) == lora_scale(3, 5.0, rslora)
    x = torch.randn(4, 2, 8, requires_grad=True)
    y = layer(x)
    # explicit: y = x W^T + bias + s * x A^T B^T  (Hu et al. 2021, eq. 3)
    expected = x @ base.weight.T + base.bias + s * (x @ a.T) @ b.T
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    g2 = g.reshape(-1, 6)
    x2 = x.detach().reshape(-1, 8)
    torch.testing.assert_close(layer.lora_B["default"].weight.grad, s * g2.T @ (x2 @ a.T), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(layer.lora_A["default"].weight.grad, s * (g2 @ b).T @ x2, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(x.grad, g @ (base.weight + s * b @ a), atol=1e-5, rtol=1e-6)


def test_input_without_grad_still_trains_adapter():
    layer = LoraLayer(nn.Linear(8, 6))
    layer.base_layer.requires_grad_(False)
    layer.add("default", r=2, alpha=2.0)
    _filled(layer)
    layer(torch.randn(3, 8)).sum().backward()  # base output has no grad; the in-place add gives it one
    assert layer.lora_A["default"].weight.grad is not None
    with torch.inference_mode():
        layer(torch.randn(3, 8))


def test_conv1d_matches_formula_and_merges():
    torch.manual_seed(0)
    base = Conv1D(6, 8)  # nf=6 outputs, nx=8 inputs; weight (8, 6)
    nn.init.normal_(base.weight)
    layer = LoraLayer(base)
    assert layer.fan_in_fan_out and (layer.in_features, layer.out_features) == (8, 6)
    layer.add("default", r=2, alpha=4.0)
    a, b = _filled(layer)
    x = torch.randn(5, 8)
    expected = x @ base.weight + base.bias + 2.0 * (x @ a.T) @ b.T
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-6)
    w0 = base.weight.detach().clone()
    layer.merge("default")
    torch.testing.assert_close(base.weight, w0 + 2.0 * (b @ a).T, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-6)
    layer.unmerge()
    torch.testing.assert_close(base.weight, w0, atol=1e-5, rtol=1e-6)


def test_rank_bounds():
    layer = LoraLayer(nn.Linear(8, 4))
    with pytest.raises(RankwiseError, match=r"choose r in \[1, 4\]"):
        layer.add("x", r=5, alpha=1.0)
    with pytest.raises(RankwiseError, match=r"choose r in \[1, 4\]"):
        layer.add("x", r=0, alpha=1.0)
    layer.add("x", r=4, alpha=1.0)  # the bound itself is fine
    with pytest.raises(RankwiseError, match="r: got 0"):
        from_dict(LoraConfig, {"r": 0}, "method")
    with pytest.raises(RankwiseError, match="choose r in"):
        apply_lora(tiny_bert_cls(), LoraConfig(r=17, targets=["query"]))
    with pytest.raises(RankwiseError, match="LoRA supports"):
        LoraLayer(nn.Conv2d(2, 2, 1))


def test_rank_and_alpha_patterns():
    model = tiny_bert_cls()
    layers = apply_lora(model, LoraConfig(
        r=4, alpha=8, targets=["query", "value"], rank_pattern={r"layer\.1\..*query": 2},
        alpha_pattern={"value": 2.0}))
    got = {p.replace("bert.encoder.layer.", "").replace(".attention.self", ""):
           (m.ranks["default"], m.scaling["default"]) for p, m in layers.items()}
    assert got == {"0.query": (4, 2.0), "0.value": (4, 0.5), "1.query": (2, 4.0), "1.value": (4, 0.5)}
    # r = 0 through an exact structure skips a layer
    model = tiny_bert_cls()
    layers = apply_lora(model, LoraConfig(r=4, targets=["query"]),
                        structure={"bert.encoder.layer.0.attention.self.query": {"r": 0}})
    assert list(layers) == ["bert.encoder.layer.1.attention.self.query"]


@pytest.mark.parametrize("init", ["kaiming", "gaussian"])
def test_init_keeps_base_output(init):
    torch.manual_seed(0)
    layer = LoraLayer(nn.Linear(64, 32))
    layer.add("default", r=8, alpha=16.0, init=init)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert torch.count_nonzero(b) == 0 and torch.count_nonzero(a) == a.numel()
    if init == "kaiming":  # kaiming_uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
        assert a.abs().max() <= 1 / math.sqrt(64) and a.abs().max() > 0.8 / math.sqrt(64)
    else:  # N(0, 1/r^2)
        assert a.std().item() == pytest.approx(1 / 8, rel=0.1)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), layer.base_layer(x), atol=0, rtol=0)


def test_dropout_only_on_adapter_path():
    torch.manual_seed(0)
    layer = LoraLayer(nn.Linear(16, 16))
    layer.add("default", r=4, alpha=4.0, dropout=0.5)
    _filled(layer)
    x = torch.randn(8, 16)
    layer.eval()
    y_eval = layer(x)
    layer.train()
    torch.manual_seed(1)
    y1 = layer(x)
    torch.manual_seed(1)
    mask = (nn.functional.dropout(torch.ones_like(x), 0.5, True) > 0).float() * 2
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    torch.testing.assert_close(y1, layer.base_layer(x) + ((x * mask) @ a.T) @ b.T, atol=1e-5, rtol=1e-6)
    assert not torch.allclose(y1, y_eval)


def test_gpt2_all_linear_wraps_conv1d_not_head():
    model = tiny_gpt2_lm()
    layers = apply_lora(model, LoraConfig(r=2, targets="all-linear"))
    assert len(layers) == 8 and all(m.fan_in_fan_out for m in layers.values())
    assert not isinstance(model.lm_head, LoraLayer)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
