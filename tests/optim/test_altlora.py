"""AltLoRA: least-squares steps, momentum transport (hand-computed), state size, pairing."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rankwise import registry
from rankwise.adapters.lora import LoraConfig, LoraLayer, apply_lora
from rankwise.configs import from_dict
from rankwise.errors import RankwiseError
from rankwise.optim.common import state_bytes
from rankwise.optim.altlora import (AltLoRA, AltLoraConfig, AltLoraPlusConfig,
                                    altlora_param_groups, build_altlora)
from rankwise.testing import tiny_batch, tiny_bert_cls


def _layer(k=5, d=6, r=3, seed=0):
    """A float64 LoRA layer with random non-zero A and B."""
    torch.manual_seed(seed)
    layer = LoraLayer(nn.Linear(d, k, bias=False).double())
    layer.add("default", r, alpha=2.0 * r)           # s = 2
    layer.double()                                   # LoRA factors start float32 whatever the base
    with torch.no_grad():
        layer.lora_A["default"].weight.normal_()
        layer.lora_B["default"].weight.normal_()
    layer.base_layer.weight.requires_grad_(False)
    return layer


def _loss(layer, x, y):
    return 0.5 * ((layer(x) - y) ** 2).sum()


def _full_grad(layer, x, y):
    """G = dL/dW at the effective weight W + s B A."""
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w_eff = (layer.base_layer.weight + layer.scaling["default"] * b @ a).detach().requires_grad_(True)
    (0.5 * ((x @ w_eff.T - y) ** 2).sum()).backward()
    return w_eff.grad


@pytest.mark.parametrize("r", [3, 5])
def test_small_lambda_steps_are_least_squares_solutions(r):
    layer = _layer(k=5, d=6, r=r)
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    a0, b0, s = a.detach().clone(), b.detach().clone(), layer.scaling["default"]
    g_full = _full_grad(layer, x, y)
    _loss(layer, x, y).backward()
    g_b = b.grad.clone()
    lr = 0.1
    opt = AltLoRA([{"params": [a, b], "lora_pair": True}], lr=lr, betas=(0.0, 0.999),
                  weight_decay=0.0, reg=1e-12)
    opt.step()
    # A-step: argmin_X ||B X - s G|| (B has full column rank r <= k)
    ls = torch.linalg.lstsq(b0, s * g_full).solution
    torch.testing.assert_close(a.detach(), a0 - lr * ls, atol=1e-8, rtol=1e-8)
    # B-step preconditioned by the *updated* A, with autograd's g_B
    a1 = a.detach()
    torch.testing.assert_close(b.detach(), b0 - lr * g_b @ torch.linalg.inv(a1 @ a1.T),
                               atol=1e-8, rtol=1e-8)


def _scalar_reference(steps, a, b, w, x, y, s, lr, b1, b2, eps, wd, lam, plus):
    """AltLoRA on 1x1 factors, written out by hand in plain floats."""
    ma = mb = va = vb = 0.0
    b_old, a_old = b, a
    out = []
    for t in range(1, steps + 1):
        res = (w + s * b * a) * x - y                  # dL/dout for L = (out - y)^2 / 2
        ga, gb = res * x * s * b, res * x * s * a      # autograd gradients at (a, b)
        pb = 1.0 / (b * b + lam)
        g_a = pb * ga
        ma = b1 * (pb * b * b_old) * ma + (1 - b1) * g_a
        upd = ma
        if plus:
            va = b2 * va + (1 - b2) * g_a * g_a
            upd = ma / (va ** 0.5 + eps)
        a = a - lr / (1 - b1 ** t) * upd
        a = a - lr * wd * a
        b_old = b
        pa = 1.0 / (a * a + lam)
        g_b = gb * pa
        mb = b1 * mb * (a_old * a * pa) + (1 - b1) * g_b
        upd = mb
        if plus:
            vb = b2 * vb + (1 - b2) * g_b * g_b
            upd = mb / (vb ** 0.5 + eps)
        b = b - lr / (1 - b1 ** t) * upd
        b = b - lr * wd * b
        a_old = a
        out.append((a, b))
    return out


@pytest.mark.parametrize("plus", [False, True])
def test_one_by_one_case_matches_hand_computed_updates(plus):
    lin = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        lin.weight.fill_(0.3)
    layer = LoraLayer(lin)
    layer.add("default", 1, alpha=2.0)                # s = 2
    layer.double()                                    # factors start float32 whatever the base
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        a.fill_(0.7)
        b.fill_(-0.4)
    lin.weight.requires_grad_(False)
    x, y = torch.tensor([[1.5]], dtype=torch.float64), torch.tensor([[2.0]], dtype=torch.float64)
    hp = dict(lr=0.05, b1=0.9, b2=0.99, eps=1e-3, wd=0.01, lam=1e-3)
    ref = _scalar_reference(4, 0.7, -0.4, 0.3, 1.5, 2.0, 2.0, plus=plus, **hp)
    opt = AltLoRA([{"params": [a, b], "lora_pair": True}], lr=hp["lr"], betas=(hp["b1"], hp["b2"]),
                  eps=hp["eps"], weight_decay=hp["wd"], reg=hp["lam"], plus=plus)
    for ra, rb in ref:
        opt.zero_grad()
        _loss(layer, x, y).backward()
        opt.step()
        assert float(a.detach()) == pytest.approx(ra, rel=1e-10)
        assert float(b.detach()) == pytest.approx(rb, rel=1e-10)


def _tiny_lora(r=2, dtype=torch.float32):
    model = tiny_bert_cls().to(dtype)
    apply_lora(model, LoraConfig(r=r, targets="all-linear"))
    return model


def _train(model, opt, steps=3):
    batch = tiny_batch("bert")
    for _ in range(steps):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()


@pytest.mark.parametrize("cfg", [AltLoraConfig(), AltLoraPlusConfig()], ids=["altlora", "plus"])
def test_state_is_low_rank(cfg):
    model = _tiny_lora(r=2)
    opt = build_altlora(model, cfg)
    _train(model, opt, steps=2)
    per = 3 if isinstance(cfg, AltLoraPlusConfig) else 2
    expect = 0
    for group in opt.param_groups:
        if group["lora_pair"]:
            a, b = group["params"]
            (r, d), k = a.shape, b.shape[0]
            n = state_bytes(opt, [a, b]) // 4              # 0-dim step counters left out
            assert n == per * (k + d) * r < k * d          # never a full-size tensor
            expect += n
    assert expect > 0


def test_pairs_come_from_the_protocol_and_head_gets_adamw():
    model = _tiny_lora()
    layer = model.bert.encoder.layer[0].attention.self.query
    layer.add("other", 1, alpha=1.0)                   # a frozen second adapter: not paired
    for p in layer.adapter_params("other").values():
        p.requires_grad_(False)
    groups = altlora_param_groups(model, head_lr=0.5)
    pairs = [g["params"] for g in groups if g["lora_pair"]]
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert len(pairs) == len(layers)
    assert [(p[0], p[1]) for p in pairs] == [(m.lora_A["default"].weight, m.lora_B["default"].weight)
                                              for m in layers]
    head = [g for g in groups if not g["lora_pair"]]
    assert len(head) == 1 and head[0]["lr"] == 0.5
    assert {id(p) for p in head[0]["params"]} == {id(p) for p in model.classifier.parameters()}
    with pytest.raises(RankwiseError, match="needs trainable low-rank adapter pairs"):
        build_altlora(tiny_bert_cls(), AltLoraConfig())


def test_plain_group_matches_torch_adamw():
    torch.manual_seed(0)
    p1, p2 = nn.Parameter(torch.randn(4, 3)), None
    p2 = nn.Parameter(p1.detach().clone())
    ours = AltLoRA([{"params": [p1]}], lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW([p2], lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    for i in range(5):
        g = torch.randn(4, 3, generator=torch.Generator().manual_seed(i))
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p1.detach(), p2.detach(), atol=1e-6, rtol=1e-6)


def test_alternate_mode_updates_one_factor_per_phase():
    layer = _layer()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    opt = AltLoRA([{"params": [a, b], "lora_pair": True}], lr=0.01, mode="alternate",
                  alternate_every=2)
    moved = []
    for _ in range(6):
        a0, b0 = a.detach().clone(), b.detach().clone()
        opt.zero_grad()
        _loss(layer, x, y).backward()
        opt.step()
        moved.append(("A" if not torch.equal(a0, a) else "") + ("B" if not torch.equal(b0, b) else ""))
    assert moved == ["A", "A", "B", "B", "A", "A"]


def test_registry_config_and_resume_from_state_dict():
    cfg = from_dict(AltLoraPlusConfig, {"lr": 0.01, "mode": "alternate"}, "optim")
    entry = registry.get("optimizer", "altlora-plus")
    assert entry.config_cls is AltLoraPlusConfig and registry.get("optimizer", "altlora")
    model = _tiny_lora(dtype=torch.float64)
    opt = entry.builder(model, cfg)
    _train(model, opt, steps=2)
    twin = copy.deepcopy(model)
    opt2 = entry.builder(twin, cfg)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as if read from a checkpoint
    _train(model, opt, steps=2)
    _train(twin, opt2, steps=2)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    with pytest.raises(RankwiseError, match="mode"):
        from_dict(AltLoraConfig, {"mode": "both"}, "optim")
