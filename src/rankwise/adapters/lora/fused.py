"""The fused LoRA path (``train.fused_lora: auto``): one autograd node per LoRA-wrapped linear
layer, ``y = W x + b + s B A x`` (Hu et al. 2021, eq. 3; rsLoRA and GoRA only change ``s`` and
``r``), with a hand-written backward

    dB = s g^T (A x),   d(Ax) = s g B,   dA = d(Ax)^T x,   dx = g W + d(Ax) A

that equals the plain path's (:meth:`LoraLayer.forward`: the base layer, then two
``F.linear`` calls, each recorded by autograd) to the rounding of the dtype, and keeps less:

* the input ``x`` is saved once, as the caller's tensor: the plain path saves the copy that
  its cast to the factors' dtype made (under bf16 autocast: ``x`` -> float32 -> bf16, one new
  bf16 tensor per projection, so q/k/v hold three copies of one input; PEFT does the same);
* no dropout mask: the fused path is taken only while dropout is inactive (``p = 0`` or eval);
* one product for the layers that read one input (``train.fused_lora: auto``; ``unshared``
  keeps one node per layer): q, k, v (and gate, up), whose groups
  :func:`rankwise.core.shared_inputs.fix_groups` fixed before the first step, share
  ``[u_q | u_k | u_v] = x [A_q; A_k; A_v]ᵀ`` and its backward (:class:`_SharedDown`), each
  finishing with :class:`_FusedLoraUp`; only ``A`` is stacked (GQA's narrower k/v and GoRA's
  ranks are fine), at run time, from the parameters as the forward sees them (no new
  parameter, PEFT export and merge unchanged);
* ``A x`` (``r`` columns) is kept: recomputing it costs ``2 r in`` flops per token to save
  ``r`` values per token (measured in ``docs/fused-lora.md``);
* a 4-bit base (bitsandbytes ``Linear4bit``) is dequantized in the forward and again in the
  backward (:data:`KEEP_DEQUANTIZED` False): keeping the dense weight until the backward would
  hold a 16-bit copy of every layer of the step, the memory 4-bit exists to save; with
  checkpointing that copy would live only per block, but the measured time saved did not pay
  for it either (``docs/fused-lora.md``).

The gated MLP ``down(act(gate(x)) * up(x))`` gets one more node (:mod:`.fused_mlp`), which
takes ``down`` and keeps ``gate``'s and ``up``'s outputs instead of the four intermediate-width
tensors autograd keeps; it runs this module's :func:`lora_forward` / :func:`lora_backward`.

Taken while autograd records (no-grad evaluation keeps the plain path) and the layer has
exactly one active, unmerged adapter that is neither DoRA nor a residual init, its base is
``nn.Linear`` / ``Conv1D`` with a frozen weight, or a 4-bit ``Linear4bit`` whose input arrives in
its compute dtype; anything else runs the plain path.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.core import shared_inputs
from rankwise.core import weights as layer_weights
from rankwise.core.inject import is_conv1d

KEEP_DEQUANTIZED = False  # keep a 4-bit base's dense weight from forward to backward
KEEP_AX = True            # keep A x (r columns) instead of recomputing it in the backward


def _four_bit(layer: nn.Module) -> bool:
    return type(layer).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4") and \
        layer_weights.is_quantized(layer)


def eligible(layer, x: torch.Tensor) -> str | None:
    """The adapter name if ``layer`` (a ``LoraLayer``) can take the fused path on ``x``, else
    ``None``."""
    if not torch.is_grad_enabled():  # nothing to save: the plain path (and bitsandbytes' own
        return None                   # eval kernels) exactly as without the switch
    active = [n for n in layer._active if n not in layer._merged]
    if len(active) != 1 or len(layer._merged):
        return None
    name = active[0]
    if layer.is_dora(name) or name in layer.lora_initial:
        return None
    if not isinstance(layer.lora_dropout[name], nn.Identity) and layer.training:
        return None
    base = layer.base_layer
    bias = getattr(base, "bias", None)
    if bias is not None and bias.requires_grad:
        return None
    if _four_bit(base):
        qs = getattr(base.weight, "quant_state", None)
        if qs is None or getattr(qs, "packing_format_for_cpu", False):
            return None
        if base.compute_dtype is None or x.dtype != base.compute_dtype:
            return None
        return name
    if layer_weights.is_quantized(base) or base.weight.requires_grad:
        return None
    if not (type(base) is nn.Linear or is_conv1d(base)):
        return None
    return name


def _dtypes(x: torch.Tensor, weight_dtype: torch.dtype | None) -> tuple[torch.dtype, torch.dtype]:
    """``(base compute dtype, LoRA compute dtype)`` as the plain path gets them: autocast's
    dtype for both when autocast is on; else the input's for the base and float32 (the
    factors') for the low-rank term."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        cdt = torch.get_autocast_dtype(dev)
        return cdt, cdt
    return (weight_dtype or x.dtype), torch.float32



def _base(x, weight, bias, layer, four_bit, dts):
    """``x Wᵀ + b`` in the plain path's dtypes ``dts`` (:func:`_dtypes`, read before the caller
    turned autocast off); returns ``(out, the weight used, base dtype, LoRA dtype)``."""
    base_dt, lora_dt = dts
    w = layer_weights.dense_weight(layer) if four_bit else weight
    wc = w.to(base_dt)
    out = F.linear(x.to(base_dt), wc, None if bias is None else bias.to(base_dt))
    if four_bit:
        out = out.to(x.dtype)
    return out, wc, base_dt, lora_dt


def _add_up(out, u, bl, scale):
    """``out += s u Bᵀ``: accumulated inside the GEMM when the dtypes allow it."""
    if out.dtype == u.dtype and out.is_contiguous():
        out.view(-1, out.shape[-1]).addmm_(u.reshape(-1, u.shape[-1]), bl.t(), alpha=scale)
    else:
        out.add_(F.linear(u, bl).to(out.dtype), alpha=scale)


def _base_grad(ctx, g, weight):
    """``g W`` (tokens × in) in the base dtype, ``W`` dequantized again for a 4-bit base."""
    base_dt = ctx.dts[0]
    if ctx.four_bit:
        w = weight if ctx.keep_w else layer_weights.dense_weight(ctx.layer).to(base_dt)
    else:
        w = weight.to(base_dt)
    return torch.mm(g.to(base_dt).reshape(-1, g.shape[-1]), w)


def _keep_weight(ctx, four_bit, wc, weight):
    ctx.keep_w = four_bit and KEEP_DEQUANTIZED
    return wc if ctx.keep_w else (None if four_bit else weight)


def lora_forward(ctx, x, a, b, weight, bias, layer, scale, four_bit):
    """Eq. 3's forward for :class:`_FusedLora` and the gated MLP node (:mod:`.fused_mlp`):
    ``(out, A x, the weight to save)``; records on ``ctx`` what :func:`lora_backward` reads.

    Args:
        ctx: The autograd node's context.
        x: The input (..., in).
        a, b: The factors ``A`` (r, in) and ``B`` (out, r).
        weight, bias: The frozen base weight (``None`` for a 4-bit base) and bias.
        layer: The base layer (a 4-bit one is dequantized from it).
        scale: ``s``.
        four_bit: Whether the base is a bitsandbytes 4-bit layer.

    Returns:
        ``(out (..., out), A x (..., r), weight to save or None)``.
    """
    dts = _dtypes(x, x.dtype if four_bit else weight.dtype)
    with torch.autocast(x.device.type, enabled=False):
        out, wc, base_dt, lora_dt = _base(x, weight, bias, layer, four_bit, dts)
        ax = F.linear(x.to(lora_dt), a.to(lora_dt))
        _add_up(out, ax, b.to(lora_dt), scale)
    ctx.layer, ctx.scale, ctx.four_bit = layer, scale, four_bit
    ctx.dts = (base_dt, lora_dt, out.dtype)
    return out, ax, _keep_weight(ctx, four_bit, wc, weight)


def lora_factor_grads(ctx, g, x, ax, a, b, need_a, need_b):
    """The factors' part of the backward: ``(d(Ax) = s g B, dA, dB)`` (``dA``/``dB`` ``None``
    where not needed); ``ax`` ``None`` recomputes ``A x``. ``ctx`` as :func:`lora_forward` left it."""
    lora_dt = ctx.dts[1]
    da = db = None
    with torch.autocast(g.device.type, enabled=False):
        xl = x.to(lora_dt)
        ax = F.linear(xl, a.to(lora_dt)) if ax is None else ax
        # s is applied to the r-column products, not to a copy of g (out, per token)
        gl_ = g.to(lora_dt).reshape(-1, g.shape[-1])
        if need_b:
            db = torch.mm(gl_.t(), ax.reshape(-1, ax.shape[-1])).mul_(ctx.scale).to(b.dtype)
        gax = torch.mm(gl_, b.to(lora_dt)).mul_(ctx.scale)             # (tokens, r)
        del gl_
        if need_a:
            da = torch.mm(gax.t(), xl.reshape(-1, xl.shape[-1])).to(a.dtype)
    return gax, da, db


def lora_input_grad(ctx, g, gax, a, weight, x_shape, x_dtype):
    """``dx = g W + d(Ax) A`` (..., in) in ``x_dtype``; ``gax`` from :func:`lora_factor_grads`."""
    lora_dt = ctx.dts[1]
    with torch.autocast(g.device.type, enabled=False):
        dx = _base_grad(ctx, g, weight)                                   # (tokens, in)
        if dx.dtype == lora_dt:  # + d(Ax) A accumulated in the GEMM
            dx = dx.addmm_(gax, a.to(lora_dt)).to(x_dtype)
        else:
            dx = dx.to(x_dtype) + torch.mm(gax, a.to(lora_dt)).to(x_dtype)
    return dx.view(*x_shape[:-1], dx.shape[-1])


def lora_backward(ctx, g, x, ax, a, b, weight, need_x, need_a, need_b):
    """The backward of the module docstring: ``(dx, dA, dB)``, each ``None`` where not needed;
    ``ax`` ``None`` recomputes ``A x``. ``ctx`` as :func:`lora_forward` left it."""
    gax, da, db = lora_factor_grads(ctx, g, x, ax, a, b, need_a, need_b)
    dx = lora_input_grad(ctx, g, gax, a, weight, x.shape, x.dtype) if need_x else None
    return dx, da, db


class _FusedLora(torch.autograd.Function):
    """LoRA's ``W x + b + s B A x`` (Hu et al. 2021, eq. 3) for a frozen ``W`` (dense, or a
    4-bit layer dequantized on use), with the backward of the module docstring."""

    @staticmethod
    def forward(ctx, x, a, b, weight, bias, layer, scale, four_bit):
        out, ax, kept = lora_forward(ctx, x, a, b, weight, bias, layer, scale, four_bit)
        ctx.save_for_backward(x, ax if KEEP_AX else None, a, b, kept)
        return out

    @staticmethod
    def backward(ctx, g):
        x, ax, a, b, weight = ctx.saved_tensors
        dx, da, db = lora_backward(ctx, g, x, ax, a, b, weight, *ctx.needs_input_grad[:3])
        return dx, da, db, None, None, None, None, None


class _SharedDown(torch.autograd.Function):
    """The down-projections of the LoRA layers that read one input, as one product:
    ``[u_1 | ... | u_k] = x [A_1; ...; A_k]ᵀ`` (the ``A x`` of eq. 3 for each layer), with

        d[A_1; ...; A_k] = [du_1 | ... | du_k]ᵀ x,     dx = [du_1 | ... | du_k] [A_1; ...; A_k]

    - one GEMM each instead of ``k``. The ``A_i`` are stacked at run time (``torch.cat`` of the
    parameters as they are in this forward: FSDP2's unsharded ones); nothing is stored. A ``u_i``
    no layer took (its partner was called on another tensor, or not at all) has no gradient and
    is left out of the backward, so its ``A_i`` gets nothing from this node, not a zero."""

    @staticmethod
    def forward(ctx, x, lora_dt, *a):
        with torch.autocast(x.device.type, enabled=False):
            stacked = torch.cat([t.to(lora_dt) for t in a])
            u = F.linear(x.to(lora_dt), stacked)
        ctx.save_for_backward(x, *a)
        ctx.lora_dt, ctx.ranks = lora_dt, [t.shape[0] for t in a]
        ctx.set_materialize_grads(False)  # an unused u_i's gradient stays None
        return tuple(p.contiguous() for p in u.split(ctx.ranks, dim=-1))

    @staticmethod
    def backward(ctx, *gu):
        x, *a = ctx.saved_tensors
        lora_dt = ctx.lora_dt
        da, dx = [None] * len(a), None
        used = [i for i, t in enumerate(gu) if t is not None]
        if not used:
            return (dx, None, *da)
        with torch.autocast(x.device.type, enabled=False):
            du = torch.cat([gu[i].to(lora_dt).reshape(-1, gu[i].shape[-1]) for i in used], dim=1)
            if any(ctx.needs_input_grad[2 + i] for i in used):
                dstack = torch.mm(du.t(), x.to(lora_dt).reshape(-1, x.shape[-1]))  # (sum r_i, in)
                for i, d in zip(used, dstack.split([ctx.ranks[i] for i in used])):
                    da[i] = d.to(a[i].dtype)
            if ctx.needs_input_grad[0]:
                stacked = torch.cat([a[i].to(lora_dt) for i in used])
                dx = torch.mm(du, stacked).to(x.dtype).view(x.shape)
        return (dx, None, *da)


class _FusedLoraUp(torch.autograd.Function):
    """The rest of eq. 3 for a layer whose ``u = A x`` came from :class:`_SharedDown`:
    ``W x + b + s u Bᵀ``, backward ``dB = s gᵀ u``, ``du = s g B``, ``dx = g W`` (the ``du A``
    part of ``dx`` is the shared node's). Saves ``u`` and no ``x``."""

    @staticmethod
    def forward(ctx, x, u, b, weight, bias, layer, scale, four_bit):
        dts = _dtypes(x, x.dtype if four_bit else weight.dtype)
        with torch.autocast(x.device.type, enabled=False):
            out, wc, base_dt, lora_dt = _base(x, weight, bias, layer, four_bit, dts)
            _add_up(out, u, b.to(lora_dt), scale)
        ctx.save_for_backward(u, b, _keep_weight(ctx, four_bit, wc, weight))
        ctx.layer, ctx.scale, ctx.four_bit = layer, scale, four_bit
        ctx.dts, ctx.x_meta = (base_dt, lora_dt, out.dtype), (x.shape, x.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        u, b, weight = ctx.saved_tensors
        lora_dt = ctx.dts[1]
        dx = du = db = None
        with torch.autocast(g.device.type, enabled=False):
            gl_ = g.to(lora_dt).reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[2]:
                db = torch.mm(gl_.t(), u.reshape(-1, u.shape[-1])).mul_(ctx.scale).to(b.dtype)
            if ctx.needs_input_grad[1]:
                du = torch.mm(gl_, b.to(lora_dt)).mul_(ctx.scale).view(u.shape)
            del gl_
            if ctx.needs_input_grad[0]:
                shape, dtype = ctx.x_meta
                dx = _base_grad(ctx, g, weight).to(dtype).view(*shape[:-1], -1)
        return dx, du, db, None, None, None, None, None


# ----- which layers share one product ------------------------------------------------------
# Fixed before the first step, not learned while running: rankwise.core.shared_inputs.fix_groups
# (called by train.fused_lora: auto) probes the model once and holds, per leader, the layers
# called right after it on the same tensor (q -> k, v; gate -> up). Every forward - the first
# micro-batch of a run or of a resume, a checkpointing recompute, a rebuilt federated client -
# therefore makes the same choice. An eligible leader computes the stacked product for its
# eligible partners and leaves their ``u`` in ``_STATE.entry``, keyed by the input tensor (weak
# reference, version counter, autocast state); a partner takes its ``u`` only from an entry of
# the very tensor it was called with, else it computes its own. A caller that runs one
# projection alone, a hook that replaces an input, or a tensor changed in place therefore never
# sees another call's product (and a product its partner did not take gives it no gradient).


class _State(threading.local):
    entry = None   # (weakref x, key, {id(layer): (u, A, A._version)}): partners' products


_STATE = _State()


def _key(x: torch.Tensor):
    dev = x.device.type
    return (x._version, x.device, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))


def _partners(layer, x, a) -> list | None:
    """The eligible partners of leader ``layer`` on ``x``: ``[(layer, adapter name), ...]``."""
    out = []
    for p in shared_inputs.partners(layer):
        name = eligible(p, x) if getattr(p, "fused_lora", False) else None
        if name is None:
            continue
        pa = p.lora_A[name].weight
        if pa.dtype == a.dtype and pa.device == a.device and pa.shape[1] == a.shape[1]:
            out.append((p, name))
    return out or None


def _shared_u(layer, x: torch.Tensor, name: str):
    """``u = A x`` of ``layer`` from a shared product, or ``None`` (then the layer computes it)."""
    if torch.compiler.is_compiling():
        return None
    a = layer.lora_A[name].weight
    key = _key(x)
    entry = _STATE.entry
    if entry is not None and entry[0]() is x and entry[1] == key:
        got = entry[2].pop(id(layer), None)
        if not entry[2]:
            _STATE.entry = None
        if got is not None and got[1] is a and got[2] == a._version:
            return got[0]
    partners = _partners(layer, x, a)
    if partners is None:
        return None
    weights = [a] + [p.lora_A[n].weight for p, n in partners]
    us = _SharedDown.apply(x, _dtypes(x, None)[1], *weights)
    _STATE.entry = (weakref.ref(x), key,
                    {id(p): (u, w, w._version) for (p, _), u, w in zip(partners, us[1:], weights[1:])})
    return us[0]


def forward(layer, x: torch.Tensor, name: str) -> torch.Tensor:
    """The fused forward of ``layer``'s adapter ``name`` (see :func:`eligible`)."""
    base = layer.base_layer
    four_bit = _four_bit(base)
    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
    weight = None if four_bit else layer_weights.dense_weight(base)
    bias = getattr(base, "bias", None)
    u = _shared_u(layer, x, name)
    if u is not None:
        return _FusedLoraUp.apply(x, u, b, weight, bias, base, layer.scaling[name], four_bit)
    return _FusedLora.apply(x, a, b, weight, bias, base, layer.scaling[name], four_bit)
