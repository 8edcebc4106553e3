"""LoPE: the poisoning expert is masked at inference and the inference output changes only
through it; noise reaches the poisoning expert's input only, and only in training."""
from __future__ import annotations

import torch
from torch import nn

from rankwise.adapters.lope import LopeConfig, LopeLayer, apply_lope
from rankwise.testing import tiny_batch, tiny_gpt2_lm


def make_layer(noise_std=0.5) -> LopeLayer:
    torch.manual_seed(0)
    layer = LopeLayer(nn.Linear(6, 5))
    e = layer.add("default", r=3, num_experts=2, alpha=6.0, noise_std=noise_std)
    with torch.no_grad():
        e.lora_B.normal_()
        e.router.weight.normal_()
    return layer


def parts(layer, x):
    """(normal experts' term, poisoning expert's term without noise), both scaled by s = 2."""
    e = layer.experts["default"]
    g = torch.softmax(x @ e.router.weight.T, -1)                     # (..., 3)
    h = x @ e.lora_A.T
    normal = sum(g[..., i:i + 1] * (h @ e.lora_B[i].T) for i in range(2)) * 2.0
    poison = g[..., 2:3] * (h @ e.lora_B[2].T) * 2.0
    return normal, poison


def test_inference_changes_only_through_the_masked_expert():
    layer = make_layer(noise_std=0.0)
    x = torch.randn(4, 7, 6)
    normal, poison = parts(layer, x)
    base = layer.base_layer(x)
    layer.train()
    torch.testing.assert_close(layer(x), base + normal + poison, atol=1e-5, rtol=0)
    layer.eval()
    inference = layer(x)
    torch.testing.assert_close(inference, base + normal, atol=1e-5, rtol=0)   # no renormalisation
    layer.train()
    torch.testing.assert_close(layer(x) - inference, poison, atol=1e-5, rtol=0)
    with torch.no_grad():                     # the poisoning B does not reach inference at all
        layer.experts["default"].lora_B[2].add_(10.0)
    layer.eval()
    assert torch.equal(layer(x), inference)
    with torch.no_grad():
        layer.experts["default"].lora_B[0].add_(1.0)
    assert not torch.allclose(layer(x), inference)


def test_noise_goes_only_into_the_poisoning_expert():
    layer = make_layer(noise_std=0.5)
    e = layer.experts["default"]
    x = torch.randn(3, 6)
    normal, _ = parts(layer, x)
    layer.train()
    torch.manual_seed(123)
    got = layer(x)
    torch.manual_seed(123)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    eps = 0.5 * rms * torch.randn_like(x)
    g = torch.softmax(x @ e.router.weight.T, -1)
    poison = g[:, 2:3] * ((x + eps) @ e.lora_A.T @ e.lora_B[2].T) * 2.0
    torch.testing.assert_close(got, layer.base_layer(x) + normal + poison, atol=1e-5, rtol=0)
    layer.eval()
    assert torch.equal(layer(x), layer(x))                            # deterministic at inference


def test_router_statistics_mask_the_poisoning_expert_in_eval():
    layer = make_layer()
    layer.train()
    layer(torch.randn(4, 6))
    layer.eval()
    layer(torch.randn(2, 6))
    stats = layer.statistics()["default"]
    assert stats["experts"] == 3 and stats["train"]["selected"] == [1.0, 1.0, 1.0]
    assert stats["eval"]["selected"] == [1.0, 1.0, 0.0] and stats["eval"]["load"][2] == 0.0


def test_parameter_budget_and_base_at_init():
    base, model = tiny_gpt2_lm(), tiny_gpt2_lm()
    layers = apply_lope(model, LopeConfig(r=2, num_experts=2, targets=["c_attn"]))
    layer = next(iter(layers.values()))
    n_in, n_out = layer.in_features, layer.out_features                # GPT-2 Conv1D 16 -> 48
    assert sum(p.numel() for p in layer.adapter_params("default").values()) == 2 * n_in + 3 * (2 * n_out + n_in)
    batch = {k: v for k, v in tiny_batch("gpt2").items() if k != "labels"}
    model.train()                                                     # even with the poison active
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, base(**batch).logits, atol=1e-6, rtol=0)
