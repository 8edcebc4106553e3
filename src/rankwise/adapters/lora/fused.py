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
* ``A x`` (``r`` columns) is kept: recomputing it costs ``2 r in`` flops per token to save
  ``r`` values per token (measured in ``docs/fused-lora.md``);
* a 4-bit base (bitsandbytes ``Linear4bit``) is dequantized in the forward and again in the
  backward (:data:`KEEP_DEQUANTIZED` False): keeping the dense weight until the backward would
  hold a 16-bit copy of every layer of the step, the memory 4-bit exists to save; with
  checkpointing that copy would live only per block, but the measured time saved did not pay
  for it either (``docs/fused-lora.md``).

Taken while autograd records (no-grad evaluation keeps the plain path) and the layer has
exactly one active, unmerged adapter that is neither DoRA nor a residual init, its base is
``nn.Linear`` / ``Conv1D`` with a frozen weight, or a 4-bit ``Linear4bit`` whose input arrives in
its compute dtype; anything else runs the plain path.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

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


class _FusedLora(torch.autograd.Function):
    """LoRA's ``W x + b + s B A x`` (Hu et al. 2021, eq. 3) for a frozen ``W`` (dense, or a
    4-bit layer dequantized on use), with the backward of the module docstring."""

    @staticmethod
    def forward(ctx, x, a, b, weight, bias, layer, scale, four_bit):
        dev = x.device.type
        if four_bit:
            base_dt, lora_dt = _dtypes(x, x.dtype)
        else:
            base_dt, lora_dt = _dtypes(x, weight.dtype)
        with torch.autocast(dev, enabled=False):
            w = layer_weights.dense_weight(layer) if four_bit else weight
            wc = w.to(base_dt)
            out = F.linear(x.to(base_dt), wc, None if bias is None else bias.to(base_dt))
            if four_bit:
                out = out.to(x.dtype)
            xl = x.to(lora_dt)
            al, bl = a.to(lora_dt), b.to(lora_dt)
            ax = F.linear(xl, al)
            if out.dtype == lora_dt and out.is_contiguous():  # out += s (A x) B^T in the GEMM
                out.view(-1, out.shape[-1]).addmm_(ax.reshape(-1, ax.shape[-1]), bl.t(), alpha=scale)
            else:
                out.add_(F.linear(ax, bl).to(out.dtype), alpha=scale)
        keep_w = four_bit and KEEP_DEQUANTIZED
        ctx.save_for_backward(x, ax if KEEP_AX else None, a, b,
                              wc if keep_w else (None if four_bit else weight))
        ctx.layer, ctx.scale, ctx.four_bit, ctx.keep_w = layer, scale, four_bit, keep_w
        ctx.dts = (base_dt, lora_dt, out.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        x, ax, a, b, weight = ctx.saved_tensors
        base_dt, lora_dt, out_dt = ctx.dts
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        dx = da = db = None
        with torch.autocast(g.device.type, enabled=False):
            xl = x.to(lora_dt)
            al, bl = a.to(lora_dt), b.to(lora_dt)
            if ax is None:
                ax = F.linear(xl, al)
            # s is applied to the r-column products, not to a copy of g (out, per token)
            gl_ = g.to(lora_dt).reshape(-1, g.shape[-1])
            ax2 = ax.reshape(-1, ax.shape[-1])
            if need_b:
                db = torch.mm(gl_.t(), ax2).mul_(ctx.scale).to(b.dtype)
            gax = torch.mm(gl_, bl).mul_(ctx.scale)                         # (tokens, r)
            del gl_
            if need_a:
                da = torch.mm(gax.t(), xl.reshape(-1, xl.shape[-1])).to(a.dtype)
            if need_x:
                if ctx.four_bit:
                    w = weight if ctx.keep_w else layer_weights.dense_weight(ctx.layer).to(base_dt)
                else:
                    w = weight.to(base_dt)
                dx = torch.mm(g.to(base_dt).reshape(-1, g.shape[-1]), w)      # (tokens, in)
                if dx.dtype == lora_dt:  # + d(Ax) A accumulated in the GEMM
                    dx = dx.addmm_(gax, al).to(x.dtype)
                else:
                    dx = dx.to(x.dtype) + torch.mm(gax, al).to(x.dtype)
                dx = dx.view(*x.shape[:-1], dx.shape[-1])
        return dx, da, db, None, None, None, None, None


def forward(layer, x: torch.Tensor, name: str) -> torch.Tensor:
    """The fused forward of ``layer``'s adapter ``name`` (see :func:`eligible`)."""
    base = layer.base_layer
    four_bit = _four_bit(base)
    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
    weight = None if four_bit else layer_weights.dense_weight(base)
    bias = getattr(base, "bias", None)
    return _FusedLora.apply(x, a, b, weight, bias, base, layer.scaling[name], four_bit)
