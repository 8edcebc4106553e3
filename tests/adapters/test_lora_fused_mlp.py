"""The gated MLP node of the fused LoRA path (``adapters/lora/fused_mlp.py``): it keeps 2 of the
4 intermediate-width tensors autograd keeps for ``down(act(gate(x)) * up(x))`` and gives the
plain path's losses and gradients (float32 to 1e-6; with a frozen down-projection, a GELU
activation and checkpointing too); it runs only where the module's forward is exactly that and
autograd records; it adds no parameter or key. (The full-model equality in fp32, bf16 and NF4,
with the node counted per block, is ``test_lora_fused.py``'s ``check``.)"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from rankwise.adapters.lora import LoraConfig, apply_lora, fused_mlp
from rankwise.recipes.model import enable_checkpointing
from rankwise.recipes.session import set_fused_lora
from rankwise.testing import randomize_trainable, tiny_llama64

VOCAB, TOKENS, INTER = 96, 2 * 16, 128  # tiny_llama64: intermediate 128, 2 blocks


def batch(seed: int = 1) -> dict:
    ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def model_with(targets="all-linear", act: nn.Module | None = None, ckpt=False, **lora):
    model = tiny_llama64(VOCAB)
    if act is not None:
        for layer in model.model.layers:
            layer.mlp.act_fn = act
    torch.manual_seed(3)
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=targets, **lora))
    randomize_trainable(model, seed=7, std=0.05)
    if ckpt:
        enable_checkpointing(model)
    return model.train()


def step(model, setting):
    """Loss, gradients of every trainable tensor, and the gated nodes that ran."""
    calls = []
    real = fused_mlp._GatedDown.apply
    fused_mlp._GatedDown.apply = lambda *a: calls.append(1) or real(*a)
    try:
        set_fused_lora(model, setting)
        model.zero_grad(set_to_none=True)
        loss = model(**batch()).loss
        loss.backward()
    finally:
        fused_mlp._GatedDown.apply = real
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, len(calls)


def saved_intermediate(model, setting) -> tuple[int, int]:
    """``(tensors, bytes)`` of intermediate width (distinct storages) one forward saves."""
    set_fused_lora(model, setting)
    seen = {}

    def pack(t):
        if t.dim() and t.shape[-1] == INTER and t.numel() == TOKENS * INTER:  # (B, T, I) or (B*T, I)
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch()).loss.backward()
    return len(seen), sum(seen.values())


def test_keeps_two_of_the_four_intermediate_tensors():
    model = model_with()
    assert saved_intermediate(model, "off") == (4 * 2, 4 * 2 * TOKENS * INTER * 4)  # g, s, u, h
    assert saved_intermediate(model, "auto") == (2 * 2, 2 * 2 * TOKENS * INTER * 4)  # g, u


@pytest.mark.parametrize("case", ["lora-ckpt", "frozen-down", "gelu", "unshared"])
def test_equal_to_plain(case):
    """fp32: the loss and every gradient equal the plain path's (1e-6 of the largest)."""
    model = {"lora-ckpt": lambda: model_with(ckpt=True),
             "frozen-down": lambda: model_with(targets=["q_proj", "v_proj", "gate_proj"]),
             "gelu": lambda: model_with(act=nn.GELU(approximate="tanh")),
             "unshared": lambda: model_with()}[case]()
    loss_p, grad_p, n_p = step(model, "off")
    loss_f, grad_f, n_f = step(model, "unshared" if case == "unshared" else "auto")
    assert n_p == 0 and n_f == 2 * (2 if case == "lora-ckpt" else 1)  # per block (+ the recompute)
    torch.testing.assert_close(loss_f, loss_p, atol=1e-6, rtol=1e-6)
    scale = max(g.abs().max() for g in grad_p.values())
    for n in grad_p:
        assert grad_p[n].abs().sum() > 0, n
        torch.testing.assert_close(grad_f[n], grad_p[n], atol=1e-6 * scale, rtol=1e-6, msg=n)


class SiluMLP(nn.Module):  # rankwise's TPA model's MLP: F.silu, not an act_fn module
    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = \
            mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def test_the_plain_path_where_the_node_does_not_apply():
    model = model_with()
    mlp = model.model.layers[0].mlp
    assert fused_mlp.gated_mlp(mlp) and not fused_mlp.gated_mlp(SiluMLP(mlp))
    assert not fused_mlp.gated_mlp(model.model.layers[0].self_attn)
    prelu = copy.deepcopy(mlp)
    prelu.act_fn = nn.PReLU()  # an activation with a parameter
    assert not fused_mlp.gated_mlp(prelu)
    set_fused_lora(model, "auto")
    x = torch.ones(1, 128)
    with torch.no_grad():
        assert fused_mlp._plan(mlp.down_proj, mlp.act_fn, x, x) is None  # no autograd: plain
    assert fused_mlp._plan(mlp.down_proj, mlp.act_fn, x, x) is not None
    assert fused_mlp._plan(mlp.down_proj, mlp.act_fn, x, x.double()) is None
    handle = mlp.down_proj.register_forward_hook(lambda *a: None)
    assert fused_mlp._plan(mlp.down_proj, mlp.act_fn, x, x) is None  # a hook must see its call
    handle.remove()
    assert step(model_with(dropout=0.1), "auto")[2] == 0      # dropout while training
    assert step(model_with(use_dora=True), "auto")[2] == 0    # DoRA's down-projection
    model.eval()
    with torch.no_grad():
        set_fused_lora(model, "auto")
        out_f = model(**batch()).logits
        set_fused_lora(model, "off")
        assert torch.equal(out_f, model(**batch()).logits)


def test_install_is_a_compute_path_only():
    model = model_with()
    keys = list(model.state_dict())
    mlps = [layer.mlp for layer in model.model.layers]
    set_fused_lora(model, "auto")
    assert all(isinstance(m.__dict__["forward"], fused_mlp._Forward) for m in mlps)
    assert list(model.state_dict()) == keys and fused_mlp.install(model, True) == 2
    twin = copy.deepcopy(model)  # a DPO reference: its node serves its own modules
    assert twin.model.layers[0].mlp.forward.module is twin.model.layers[0].mlp
    set_fused_lora(model, "off")
    assert all("forward" not in m.__dict__ for m in mlps)
    other = model_with()
    own = other.model.layers[0].mlp.forward = lambda x: x  # an instance forward of another origin
    assert fused_mlp.install(other, True) == 1 and other.model.layers[0].mlp.forward is own
