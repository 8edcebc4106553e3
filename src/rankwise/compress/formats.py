"""Compact storage shared by the families: bit packing, sparse matrices, integer codes.

Everything here is exact: ``decode(encode(x)) == x`` bit for bit. Sizes are what the tensors
take, so the bytes a report counts are the bytes a file holds:

* a b-bit integer costs b bits (packed into a ``uint8`` stream, :func:`pack_bits`);
* an unstructured sparse matrix costs its kept values plus one mask bit per position;
* an N:M sparse matrix costs its kept values plus ``ceil(log2 M)`` bits per kept value.
"""
from __future__ import annotations

import math

import torch


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers ``< 2**bits`` into a ``uint8`` stream, ``bits`` each.

    Args:
        codes: Integer tensor (any shape; read flat, row-major).
        bits: 1 to 8.

    Returns:
        ``ceil(numel * bits / 8)`` bytes.
    """
    assert 1 <= bits <= 8
    flat = codes.reshape(-1).to(torch.int64)
    assert flat.numel() == 0 or (int(flat.min()) >= 0 and int(flat.max()) < 2 ** bits)
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((flat[:, None] >> shifts) & 1).reshape(-1)          # (numel * bits,) little-endian
    pad = (-stream.numel()) % 8
    stream = torch.cat([stream, stream.new_zeros(pad)]).reshape(-1, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int64)
    return (stream * weights).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` integers, as ``int64``."""
    stream = ((packed.to(torch.int64)[:, None] >> torch.arange(8)) & 1).reshape(-1)
    stream = stream[: count * bits].reshape(count, bits)
    return (stream << torch.arange(bits)).sum(1)


def index_bits(m: int) -> int:
    """Bits of a position inside a group of ``m`` (2 for 2:4)."""
    return max(1, math.ceil(math.log2(m)))


def encode_sparse(weight: torch.Tensor, keep: torch.Tensor, nm: tuple[int, int] | None,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Store the kept entries of ``weight``.

    Args:
        weight: ``(out, in)``; entries outside ``keep`` are ignored.
        keep: Boolean ``(out, in)`` mask of kept positions (exactly N per group for N:M).
        nm: ``(N, M)`` or ``None`` for unstructured.
        dtype: Storage dtype of the values (the original weight's).

    Returns:
        Unstructured: ``{"values", "mask"}``; N:M: ``{"values" (out, in·N/M), "index"}``.
    """
    if nm is None:
        return {"values": weight[keep].to(dtype), "mask": pack_bits(keep.reshape(-1), 1)}
    n, m = nm
    out_f, in_f = weight.shape
    groups = keep.reshape(out_f, in_f // m, m)
    assert bool((groups.sum(-1) == n).all()), "an N:M mask keeps exactly N per group"
    pos = torch.nonzero(groups.reshape(-1, m), as_tuple=True)[1]   # kept positions, group order
    values = weight.reshape(out_f, in_f // m, m)[groups].reshape(out_f, -1)
    return {"values": values.to(dtype), "index": pack_bits(pos, index_bits(m))}


def decode_sparse(tensors: dict[str, torch.Tensor], shape: tuple[int, int],
                  nm: tuple[int, int] | None) -> torch.Tensor:
    """Inverse of :func:`encode_sparse`: the ``(out, in)`` float32 matrix (zeros elsewhere)."""
    out_f, in_f = shape
    dense = torch.zeros(out_f * in_f, dtype=torch.float32)
    values = tensors["values"].float().reshape(-1)
    if nm is None:
        keep = unpack_bits(tensors["mask"], 1, out_f * in_f).bool()
        dense[keep] = values
        return dense.reshape(out_f, in_f)
    n, m = nm
    groups = out_f * in_f // m
    pos = unpack_bits(tensors["index"], index_bits(m), groups * n).reshape(groups, n)
    flat = (torch.arange(groups)[:, None] * m + pos).reshape(-1)
    dense[flat] = values
    return dense.reshape(out_f, in_f)


def sparse_keep(tensors: dict[str, torch.Tensor], shape: tuple[int, int],
                nm: tuple[int, int] | None) -> torch.Tensor:
    """The boolean ``(out, in)`` mask of kept positions stored in a sparse compact form."""
    out_f, in_f = shape
    if nm is None:
        return unpack_bits(tensors["mask"], 1, out_f * in_f).bool().reshape(out_f, in_f)
    n, m = nm
    groups = out_f * in_f // m
    pos = unpack_bits(tensors["index"], index_bits(m), groups * n).reshape(groups, n)
    keep = torch.zeros(groups, m, dtype=torch.bool)
    keep[torch.arange(groups)[:, None], pos] = True
    return keep.reshape(out_f, in_f)


def quantize_uniform(w: torch.Tensor, bits: int, scale: torch.Tensor,
                     zero: torch.Tensor) -> torch.Tensor:
    """Asymmetric uniform codes ``clamp(round(w / scale) + zero, 0, 2^b - 1)`` (broadcasting)."""
    return torch.clamp(torch.round(w / scale) + zero, 0, 2 ** bits - 1)


def minmax_params(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row min-max ``(scale, zero)`` of ``w`` (``(rows, cols)``) for ``bits``-bit codes.

    The range always contains 0; the scale is rounded to float16 *before* it is used, so the
    stored scale reproduces the codes' values exactly. Returns ``(rows, 1)`` tensors.
    """
    lo = torch.clamp(w.min(1, keepdim=True).values, max=0.0)
    hi = torch.clamp(w.max(1, keepdim=True).values, min=0.0)
    levels = 2 ** bits - 1
    scale = ((hi - lo) / levels).clamp(min=1e-8).half().float()
    zero = torch.clamp(torch.round(-lo / scale), 0, levels)
    return scale, zero


def encode_uniform(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bits: int) -> dict[str, torch.Tensor]:
    """Store ``(out, in)`` codes and ``(out, groups)`` scales/zeros: codes and zero points
    bit-packed at ``bits``, scales as float16."""
    return {"codes": pack_bits(codes, bits), "scales": scales.half(),
            "zeros": pack_bits(zeros, bits)}


def decode_uniform(tensors: dict[str, torch.Tensor], shape: tuple[int, int], bits: int,
                   group_size: int) -> torch.Tensor:
    """Inverse of :func:`encode_uniform`: ``(code − zero) · scale`` per group, float32."""
    out_f, in_f = shape
    groups = math.ceil(in_f / group_size)
    codes = unpack_bits(tensors["codes"], bits, out_f * in_f).reshape(out_f, in_f).float()
    zeros = unpack_bits(tensors["zeros"], bits, out_f * groups).reshape(out_f, groups).float()
    scales = tensors["scales"].float().reshape(out_f, groups)
    col_group = torch.arange(in_f) // group_size
    return (codes - zeros[:, col_group]) * scales[:, col_group]
