"""The fused LoRA path (``train.fused_lora: auto``) gives the plain path's losses and gradients:
float32 to 1e-6, bf16 and NF4 (bf16 compute) to a tolerance of a few bf16 roundings, with
activation checkpointing and gradient accumulation, and PEFT's loss on the same weights. The
shared q/k/v and gate/up products run from the first micro-batch (their groups are fixed by
``set_fused_lora`` before any step)."""
from __future__ import annotations


import pytest
import torch

from rankwise.adapters.lora import LoraConfig, LoraLayer, apply_lora
from rankwise.adapters.lora import fused, fused_mlp
from rankwise.core import shared_inputs
from rankwise.recipes.model import enable_checkpointing
from rankwise.recipes.session import set_fused_lora
from rankwise.testing import randomize_trainable, tiny_llama64

VOCAB = 128
BF16_TOL = 8 * torch.finfo(torch.bfloat16).eps  # a few roundings of bf16 (eps = 2^-7)


def batches(n: int = 2, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (2, 16), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def set_fused(model, on: bool) -> int:
    n = 0
    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.fused_lora, n = on, n + 1
    return n


def lora_model(dtype=torch.float32, ckpt=False, nf4=False, tmp=None, rslora=False):
    if nf4:
        from transformers import AutoModelForCausalLM

        from rankwise.recipes.model import bnb_config
        pytest.importorskip("bitsandbytes")
        tiny_llama64(VOCAB).save_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.bfloat16,
                                                     quantization_config=bnb_config("nf4", "bfloat16"))
    else:
        model = tiny_llama64(VOCAB).to(dtype)
    torch.manual_seed(3)
    apply_lora(model, LoraConfig(r=4, alpha=8, targets="all-linear", use_rslora=rslora))
    randomize_trainable(model, seed=7, std=0.05)
    if ckpt:
        enable_checkpointing(model)
    return model.train()


def run(model, fused_on: bool | str, bf16: bool, accum: int = 2):
    """The micro-batch losses and the accumulated gradients of ``accum`` micro-batches, with
    ``train.fused_lora`` set to ``fused_on`` (``True``: ``auto``) just before."""
    set_fused_lora(model, fused_on)
    model.zero_grad(set_to_none=True)
    losses = []
    for b in batches(accum):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**b).loss / accum
        loss.backward()
        losses.append(loss.detach().float())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return torch.stack(losses), grads


class Spy:
    """Counts the calls of the fused nodes (``down``: how many layers each shared product
    served; ``mlp``: the gated MLP nodes, which take ``down_proj``)."""

    def __init__(self, monkeypatch):
        self.whole, self.up, self.down, self.mlp = [], [], [], []
        for cls, log in ((fused._FusedLora, self.whole), (fused._FusedLoraUp, self.up),
                         (fused_mlp._GatedDown, self.mlp)):
            monkeypatch.setattr(cls, "forward", staticmethod(
                lambda *a, _f=cls.forward, _log=log: _log.append(1) or _f(*a)))
        monkeypatch.setattr(fused._SharedDown, "forward", staticmethod(
            lambda ctx, x, dt, *a, _f=fused._SharedDown.forward: self.down.append(len(a))
            or _f(ctx, x, dt, *a)))


def check(model, bf16: bool, atol: float, rtol: float, monkeypatch, stack: bool = True):
    """The fused path (products shared, or one node per layer) against the plain path from
    the first micro-batch on: losses, every factor's gradient, and which nodes ran."""
    loss_p, grad_p = run(model, False, bf16)
    spy = Spy(monkeypatch)
    loss_f, grad_f = run(model, "auto" if stack else "unshared", bf16)
    torch.testing.assert_close(loss_f, loss_p, atol=atol, rtol=rtol)
    assert grad_f.keys() == grad_p.keys() and len(grad_f) == 2 * 14
    scale = max(g.abs().max() for g in grad_p.values())
    for n in grad_p:
        assert grad_p[n].abs().sum() > 0, n
        torch.testing.assert_close(grad_f[n], grad_p[n], atol=atol * scale, rtol=rtol, msg=n)
    passes = 2 * (2 if model.is_activation_checkpointing else 1)  # micro-batches x recompute
    if stack:  # per block, every pass: one product for q, k, v (GQA: k, v narrower), one for gate, up
        assert spy.down == [3, 2] * 2 * passes and len(spy.up) == 5 * 2 * passes
        assert len(spy.whole) == 1 * 2 * passes  # o reads its own input
    else:  # every wrapped layer took a fused node, each micro-batch
        assert spy.down == [] and spy.up == [] and len(spy.whole) == 12 * passes
    assert len(spy.mlp) == 2 * passes  # down_proj: in each block's gated MLP node


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("stack", [False, True])
def test_fp32_equal_to_plain(ckpt, stack, monkeypatch):
    check(lora_model(ckpt=ckpt, rslora=ckpt), bf16=False, atol=1e-6, rtol=1e-6,
          monkeypatch=monkeypatch, stack=stack)


@pytest.mark.parametrize("ckpt", [False, True])
def test_bf16_equal_to_plain(ckpt, monkeypatch):
    check(lora_model(torch.bfloat16, ckpt=ckpt), bf16=True, atol=BF16_TOL, rtol=BF16_TOL,
          monkeypatch=monkeypatch)


def test_nf4_equal_to_plain(tmp_path, monkeypatch):
    model = lora_model(nf4=True, tmp=tmp_path, ckpt=True)
    check(model, bf16=True, atol=BF16_TOL, rtol=BF16_TOL, monkeypatch=monkeypatch)


def test_dropout_and_dora_keep_the_plain_path():
    model = tiny_llama64(VOCAB)
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["q_proj"], dropout=0.1))
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 64)
    assert fused.eligible(layer.train(), x) is None and fused.eligible(layer.eval(), x) == "default"
    with torch.no_grad():
        assert fused.eligible(layer.eval(), x) is None
    model = tiny_llama64(VOCAB)
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["q_proj"], use_dora=True))
    assert fused.eligible(model.model.layers[0].self_attn.q_proj, x) is None


def test_fused_loss_equals_peft():
    peft = pytest.importorskip("peft")
    ours = lora_model()
    theirs = peft.get_peft_model(tiny_llama64(VOCAB), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    dst = dict(theirs.named_parameters())
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if p.requires_grad:
                path, kind = n.split(".lora_")
                dst[f"base_model.model.{path}.lora_{kind[0]}.default.weight"].copy_(p)
    assert len(set_fused_lora(ours, "auto")) == 4  # the first step stacks q/k/v and gate/up
    b = batches(1)[0]
    loss_o = ours(**b).loss
    loss_t = theirs.train()(**b).loss
    torch.testing.assert_close(loss_o, loss_t, atol=1e-6, rtol=0)
    loss_o.backward()
    loss_t.backward()
    for path in ("mlp.down_proj", "mlp.up_proj", "self_attn.k_proj"):
        g_o = ours.get_submodule(f"model.layers.1.{path}").lora_A["default"].weight.grad
        g_t = theirs.get_submodule(f"base_model.model.model.layers.1.{path}").lora_A["default"].weight.grad
        torch.testing.assert_close(g_o, g_t, atol=1e-6, rtol=1e-5)


def test_shared_product_is_a_compute_path_only(monkeypatch):
    """The groups are fixed before any step (q -> k, v; gate -> up; nothing else); the stacked
    product changes no parameter or state-dict key, and a projection called on another tensor
    (or on the same tensor changed in place) computes its own ``A x``."""
    model = lora_model()
    keys = list(model.state_dict())
    groups = set_fused_lora(model, "auto")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert groups[:2] == [tuple(f"model.layers.0.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj",
                                                                 "self_attn.v_proj")),
                          ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")]
    assert shared_inputs.partners(attn.q_proj) == (attn.k_proj, attn.v_proj)
    assert shared_inputs.partners(mlp.gate_proj) == (mlp.up_proj,)
    assert not shared_inputs.partners(attn.o_proj) and not shared_inputs.partners(mlp.down_proj)
    assert list(model.state_dict()) == keys
    x, other = torch.randn(2, 5, 64, requires_grad=True), torch.randn(2, 5, 64)
    spy = Spy(monkeypatch)
    q = attn.q_proj(x)
    x2 = x.detach().clone().requires_grad_()
    k_alone = attn.k_proj(other)            # another input: not q's product
    assert spy.down == [3] and len(spy.up) == 1 and len(spy.whole) == 1
    q.sum().backward()                      # k's and v's untaken products: no gradient at all
    assert attn.q_proj.lora_A["default"].weight.grad.abs().sum() > 0
    assert attn.k_proj.lora_A["default"].weight.grad is None
    assert attn.v_proj.lora_A["default"].weight.grad is None
    with torch.no_grad():
        x.mul_(1)                           # bumps the version: the entry no longer matches
    v = attn.v_proj(x)
    assert len(spy.whole) == 2 and len(spy.up) == 1
    set_fused(model, False)
    torch.testing.assert_close(q, attn.q_proj(x2), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_alone, attn.k_proj(other), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v, attn.v_proj(x2), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bf16", [False, True])
def test_a_rebuilt_model_shares_from_its_first_micro_batch(bf16, monkeypatch):
    """A model rebuilt from the same weights (a resume, a federated client in another process)
    fixes the same groups and gives the same loss and gradients bit for bit on its first
    micro-batches as the model that has already run them; a deep copy (a DPO reference) has no
    groups. (With groups learned while running, the first model shared and the rebuilt one did
    not: bf16 resume ended 6e-6 apart.)"""
    import copy
    dtype = torch.bfloat16 if bf16 else torch.float32
    first = lora_model(dtype, ckpt=True)
    run(first, "auto", bf16)                    # micro-batches already run in this process
    spy = Spy(monkeypatch)
    loss_a, grad_a = run(first, "auto", bf16)
    rebuilt = lora_model(dtype, ckpt=True)
    loss_b, grad_b = run(rebuilt, "auto", bf16)
    assert torch.equal(loss_a, loss_b) and all(torch.equal(grad_a[n], grad_b[n]) for n in grad_a)
    assert spy.down == [3, 2] * 2 * 2 * 2 * 2   # both models, 2 micro-batches, forward + recompute
    twin = copy.deepcopy(rebuilt)
    assert not shared_inputs.partners(twin.model.layers[0].self_attn.q_proj)


def test_train_key_sets_the_switch_and_keeps_comparison_hashes():
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.runs import config_hash
    from rankwise.recipes.session import set_fused_lora
    plan = {"model": {"path": "tiny-llama", "task": "causal-lm"}, "method": {"name": "lora", "r": 2}}
    auto = {**plan, "train": {"fused_lora": "auto"}}
    assert config_hash(auto) == config_hash(plan) != config_hash({**plan, "train": {"fused_lora": "off"}})
    assert build_run_config({**plan, "train": {"fused_lora": False}}).train.fused_lora is False
    model = tiny_llama64(VOCAB)
    apply_lora(model, LoraConfig(r=2, alpha=4, targets="all-linear"))
    q = model.model.layers[0].self_attn.q_proj
    for key, on, shared in (("auto", True, 4), ("off", False, 0), (True, True, 4),
                            ("unshared", True, 0), (False, False, 0)):
        assert len(set_fused_lora(model, key)) == shared
        assert {m.fused_lora for m in model.modules() if isinstance(m, LoraLayer)} == {on}
        assert len(shared_inputs.partners(q)) == (2 if shared else 0)
    assert build_run_config({**plan, "train": {"fused_lora": "unshared"}}).train.fused_lora == "unshared"
