"""DoRA's weight decomposition (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation",
eq. 5): the adapted weight is a learned magnitude times a row-normalised direction,

    W' = m ⊙ (W + s B A) / ||W + s B A||_row,      y = (m / ||W + s B A||_row) ⊙ (x Wᵀ + s x Aᵀ Bᵀ) + b

with ``m`` (out,) initialised to the row norms of ``W + s B A`` (so ``W' = W`` at init) and the norm
treated as a constant in the backward pass (paper §4.3: it is detached, no gradient flows through
it). Rows are output features: PEFT's ``lora_magnitude_vector`` has one entry per output.

The norm without the dense matrix. HF PEFT materialises ``W + s B A`` (out, in) in every forward
(dequantising a 4-bit base to do so, and building ``B A`` from an identity matrix). Because the norm
is detached it can be computed under ``no_grad`` from the expansion, exactly:

    ||W_i + s (B A)_i||² = ||W_i||² + 2 s B_i · (W Aᵀ)_i + s² B_i (A Aᵀ) B_iᵀ

* ``||W_i||²`` is constant (the base is frozen): computed once per layer and cached;
* ``W Aᵀ`` (out, r) is ``F.linear(A, W)``: the base weight applied to the r rows of A, no (out, in)
  temporary for a dense base (a quantized base is dequantized, as its own forward does each step);
* ``A Aᵀ`` is (r, r).

Everything is summed in float32 (the base may be bf16); the extra cost per step is the base layer
run on r extra tokens plus O(out·r²). The expansion is exact algebra; in floating point it loses
accuracy only where the adapter nearly cancels a row of W (see :func:`row_norms`, which then
recomputes those rows directly). :func:`row_norms_direct` is the textbook formula, used by merging
and by the tests that hold the expansion to it.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.nn import functional as F

from rankwise.core import weights as layer_weights


def _no_autocast(device: torch.device):
    """A context with autocast off on ``device`` (norms are summed in float32, never in bf16);
    a device with no autocast (``meta``, where ``rankwise plan`` builds its model) has none to
    turn off."""
    if not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


@torch.no_grad()
def weight_sq_norms(base: torch.nn.Module) -> torch.Tensor:
    """``||W_i||²`` (out,) in float32 of a linear-like base layer (dense, Conv1D or quantized)."""
    w = layer_weights.dense_weight(base)                              # (out, in)
    with _no_autocast(w.device):
        return w.float().square().sum(1)


@torch.no_grad()
def weight_times(base: torch.nn.Module, a: torch.Tensor) -> torch.Tensor:
    """``W Aᵀ`` (out, r) in float32, the base weight applied to the rows of ``a`` (r, in), bias
    left out. A dense base reads its weight in place (no (out, in) temporary); a quantized one
    is dequantized to its compute dtype, as its forward does."""
    w = layer_weights.dense_weight(base)                              # (out, in), a view if dense
    with _no_autocast(w.device):
        return F.linear(a.to(w.dtype), w).float().T                   # (r, out) -> (out, r)


# A row whose squared norm is below this share of the sum of the magnitudes of its three terms
# has cancelled (W_i + s (BA)_i much shorter than W_i); it is recomputed directly (module doc).
CANCELLED = 1e-2


@torch.no_grad()
def row_norms(w_sq: torch.Tensor, wa: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              scale: float, dense: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """``||W + s B A||_row`` (out,) from the expansion in the module docstring, in float32.

    The expansion's float32 error, relative to the squared norm, is about
    ``eps * (||W_i||² + 2s|B_i·(WAᵀ)_i| + s² B_i AAᵀ B_iᵀ) / ||W_i + s(BA)_i||²``: tiny while the
    adapted row keeps a length comparable to the base row (DoRA's regime), large only when the
    adapter nearly cancels the row. Rows below :data:`CANCELLED` of that bound are recomputed
    from ``dense()`` by the direct formula when it is given.

    Args:
        w_sq: ``||W_i||²`` (out,), from :func:`weight_sq_norms`.
        wa: ``W Aᵀ`` (out, r), from :func:`weight_times`.
        a: ``A`` (r, in).
        b: ``B`` (out, r).
        scale: ``s``.
        dense: Returns the base weight (out, in), for cancelled rows only (``None``: keep the
            expansion).

    Returns:
        A detached float32 tensor (out,).
    """
    with _no_autocast(a.device):
        a, b = a.float(), b.float()
        cross = (2.0 * scale) * (b * wa).sum(1)                        # 2s B_i · (W Aᵀ)_i
        quad = (scale * scale) * ((b @ (a @ a.T)) * b).sum(1)          # s² B_i (A Aᵀ) B_iᵀ
        sq = w_sq + cross + quad
        if dense is not None and sq.device.type != "meta":             # meta: no values to test
            bad = (sq < CANCELLED * (w_sq + cross.abs() + quad)).nonzero().squeeze(1)
            if bad.numel():
                rows = dense()[bad]                                    # (k, in)
                sq[bad] = row_norms_direct(rows, a, b[bad], scale).square()
        return sq.clamp_min(torch.finfo(torch.float32).tiny).sqrt()


@torch.no_grad()
def row_norms_direct(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``||W + s B A||_row`` (out,) in float32 from the dense ``w`` (out, in): the textbook
    formula (PEFT's), for merging and as the tests' reference."""
    with _no_autocast(w.device):
        return (w.float() + scale * (b.float() @ a.float())).norm(dim=1)


def combine(out: torch.Tensor, lora: torch.Tensor, scale: float, factor: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    """``factor ⊙ (out - b + s·lora) + b``: the DoRA output from the base output ``out`` (bias
    included) and the low-rank branch ``lora = x Aᵀ Bᵀ`` (both (..., out), same dtype).

    One (..., out) tensor is kept for the backward pass (the product's other operand); ``out``
    is updated in place when autograd allows it (a linear layer's backward never reads its own
    output), as in the plain LoRA forward.

    Args:
        out: The base layer's output ``x Wᵀ + b``.
        lora: ``x Aᵀ Bᵀ``.
        scale: ``s``.
        factor: ``m / ||W + s B A||_row`` (out,), in ``out``'s dtype, carrying m's gradient.
        bias: The base layer's bias (``None`` if it has none).

    Returns:
        The layer output (..., out).
    """
    z = out + lora * scale if out._is_view() else out.add_(lora, alpha=scale)
    if bias is None:
        return z * factor
    z = z - bias.to(z.dtype)
    return torch.addcmul(bias.to(z.dtype), z, factor)
