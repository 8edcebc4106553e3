"""The gated MLP of the fused LoRA path (``train.fused_lora: auto`` / ``unshared``): for the
MLP modules whose forward is exactly ``down(act(gate(x)) * up(x))`` (Llama, Mistral, Qwen2/3,
Gemma and the other transformers classes that share that code; Shazeer 2020, GLU variants),
one autograd node for ``act(g) * u`` and the down-projection, ``g = gate(x)``, ``u = up(x)``:

    s = act(g),   h = s * u,   y = W h + b + s_lora B A h                       (forward)
    dh = dy W + d(Ah) A,   du = dh * s,   dg = act'(g) (dh * u)                    (backward)

with ``dA``, ``dB`` as :mod:`.fused`'s node (``lora_forward`` / ``lora_backward``). Autograd
would keep ``g`` (for ``act``'s backward), ``s`` and ``u`` (for the product's) and ``h`` (for
``A``'s gradient): four intermediate-width tensors per block, the largest saved activations of
a Llama step (``docs/fused-lora.md``). The node keeps ``g`` and ``u`` (and ``A h``, r columns)
and recomputes ``s`` and ``h`` in its backward, with the same elementwise ops, so the
gradients are the plain path's (``act``'s backward is autograd's own, run on the recomputed
``s``). ``gate`` and ``up`` run as they are (their fused nodes, shared product included).

Taken (:func:`install`, called by ``set_fused_lora``) for a module whose class ``forward`` has
the bytecode of :func:`_reference` (checked, not assumed from the class name), whose ``act_fn``
is a parameterless activation module of torch or transformers, and with no instance
``forward`` of its own (accelerate's hooks live there); per call only while autograd records
(no-grad evaluation and ``torch.compile``'s tracing keep the module's own forward), when ``g``
and ``u`` have one shape and dtype, and when ``down`` is a LoRA layer :func:`.fused.eligible`
accepts (or a frozen ``nn.Linear``), with no hooks on ``down`` or ``act_fn``. Anything else
runs the module's own forward. No parameter, buffer or state-dict key is added.
"""
from __future__ import annotations

import torch
from torch import nn

from rankwise.adapters.lora import fused

_ACT_MODULES = ("torch.nn.modules.activation", "transformers.activations")


def _reference(self, x):  # the forward the node replaces (transformers' LlamaMLP.forward)
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _reference_direct(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _same_code(fn, ref) -> bool:
    code, want = getattr(fn, "__code__", None), ref.__code__
    return code is not None and (code.co_code, code.co_names, code.co_consts, code.co_argcount) == \
        (want.co_code, want.co_names, want.co_consts, want.co_argcount)


def gated_mlp(module: nn.Module) -> bool:
    """Whether ``module`` computes exactly ``down(act(gate(x)) * up(x))`` (module docstring).

    Args:
        module: Any module.

    Returns:
        ``True`` for a gated MLP the node may serve.
    """
    if not all(isinstance(getattr(module, n, None), nn.Module)
               for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    fn = getattr(type(module), "forward", None)
    if not (_same_code(fn, _reference) or _same_code(fn, _reference_direct)):
        return False
    act = module.act_fn
    return type(act).__module__ in _ACT_MODULES and not any(True for _ in act.parameters())


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def _plan(down: nn.Module, act: nn.Module, g: torch.Tensor, u: torch.Tensor):
    """``(a, b, weight, bias, base, scale, four_bit)`` of the node for ``down`` on ``h = act(g) * u``
    (``a``, ``b`` ``None`` for a frozen ``nn.Linear``), or ``None``: the plain path."""
    if g.shape != u.shape or g.dtype != u.dtype or _hooked(down) or _hooked(act):
        return None
    if isinstance(getattr(type(down), "fused_lora", None), bool):  # a LoRA layer
        name = fused.eligible(down, g) if down.fused_lora else None
        if name is None or _hooked(down.base_layer):
            return None
        base = down.base_layer
        four_bit = fused._four_bit(base)
        weight = None if four_bit else fused.layer_weights.dense_weight(base)
        return (down.lora_A[name].weight, down.lora_B[name].weight, weight,
                getattr(base, "bias", None), base, down.scaling[name], four_bit)
    bias = down.bias
    if type(down) is not nn.Linear or down.weight.requires_grad or (bias is not None and bias.requires_grad):
        return None
    return None, None, down.weight, bias, down, 1.0, False


class _GatedDown(torch.autograd.Function):
    """``down(act(g) * u)`` keeping ``g``, ``u`` (and ``A h``); backward of the module docstring."""

    @staticmethod
    def forward(ctx, g, u, a, b, weight, bias, layer, scale, four_bit, act):
        h = act(g) * u                                   # (..., intermediate), as the plain path
        if a is None:                                    # a frozen nn.Linear down-projection
            dts = fused._dtypes(h, weight.dtype)
            with torch.autocast(h.device.type, enabled=False):
                out = fused._base(h, weight, bias, layer, False, dts)[0]
            ctx.dts, ctx.four_bit, ctx.keep_w, ah = dts + (out.dtype,), False, False, None
        else:
            out, ah, weight = fused.lora_forward(ctx, h, a, b, weight, bias, layer, scale, four_bit)
            ah = ah if fused.KEEP_AX else None
        del h
        dev = g.device.type
        ctx.act, ctx.autocast = act, (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.save_for_backward(g, u, ah, a, b, weight)
        return out

    @staticmethod
    def backward(ctx, dy):
        g, u, ah, a, b, weight = ctx.saved_tensors
        need_g, need_u = ctx.needs_input_grad[:2]
        with torch.autocast(g.device.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
            with torch.enable_grad():
                g_ = g.detach().requires_grad_()
                s = ctx.act(g_)                          # recomputed: the same op as the forward
            h = s.detach() * u                           # (..., intermediate)
        shape, dtype = h.shape, h.dtype
        da = db = dh = None
        if a is None:
            del h
            if need_g or need_u:
                dh = fused._base_grad(ctx, dy, weight).to(dtype).view(shape)
        else:
            gax, da, db = fused.lora_factor_grads(ctx, dy, h, ah, a, b, *ctx.needs_input_grad[2:4])
            del h                                        # before dh: one intermediate tensor less
            if need_g or need_u:
                dh = fused.lora_input_grad(ctx, dy, gax, a, weight, shape, dtype)
        dg = du = None
        if dh is not None:
            if need_u:
                du = dh * s.detach()                     # the product's backward, as autograd's
            if need_g:  # act's own backward on the recomputed s = act(g_)
                node = s.grad_fn
                if _one_op(node, g_):  # SiLU, GELU: run its node, s freed first
                    del s
                    with torch.no_grad():  # the kernel autograd runs (no double-backward form)
                        dg = node(dh.mul_(u))
                    dg = dg[0] if isinstance(dg, tuple) else dg
                else:
                    dg = torch.autograd.grad(s, g_, dh.mul_(u))[0]
        return dg, du, da, db, None, None, None, None, None, None


def _one_op(node, g_: torch.Tensor) -> bool:
    """Whether autograd ``node`` maps straight onto the leaf ``g_`` (an activation of one op)."""
    nxt = node.next_functions if node is not None else ()
    return len(nxt) == 1 and getattr(nxt[0][0], "variable", None) is g_


class _Forward:
    """The instance ``forward`` :func:`install` gives a gated MLP (picklable, deep-copied with
    its module)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        m = self.module
        if args or kwargs or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return type(m).forward(m, x, *args, **kwargs)
        g, u = m.gate_proj(x), m.up_proj(x)
        plan = _plan(m.down_proj, m.act_fn, g, u)
        if plan is None:
            return m.down_proj(m.act_fn(g) * u)
        return _GatedDown.apply(g, u, *plan, m.act_fn)


def install(model: nn.Module, on: bool) -> int:
    """Give every gated MLP of ``model`` the node's forward (``on``), or take it away.

    A module with an instance ``forward`` of another origin (accelerate's hooks) is left alone.

    Args:
        model: The adapted model.
        on: Install (``True``) or remove (``False``).

    Returns:
        How many modules have the node's forward now.
    """
    n = 0
    for m in model.modules():
        mine = isinstance(m.__dict__.get("forward"), _Forward)
        if not on and mine:
            del m.forward
        elif on and (mine or ("forward" not in m.__dict__ and gated_mlp(m))):
            m.forward = _Forward(m)
            n += 1
    return n
