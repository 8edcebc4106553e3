"""Scalar weight quantizers: round-to-nearest and GPTQ, asymmetric, per (row, group).

Storage (:func:`rankwise.compress.formats.encode_uniform`): b-bit codes and b-bit zero points
bit-packed, one float16 scale per row and group of ``group_size`` input columns.
"""
from __future__ import annotations

import math

import torch

from rankwise.compress.base import Compressed, Compressor, damped
from rankwise.compress.formats import decode_uniform, encode_uniform, minmax_params, quantize_uniform


class _Uniform(Compressor):
    """Shared decode and packing of the two scalar quantizers."""

    def _result(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                shape: tuple[int, int]) -> Compressed:
        tensors = encode_uniform(codes, scales, zeros, self.config.bits)
        weight = self.decode(tensors, shape)
        return Compressed(tensors, weight, shape[0] * shape[1],
                          {"bits_per_weight": 8 * sum(t.numel() * t.element_size() for t in tensors.values())
                           / (shape[0] * shape[1])})

    def decode(self, tensors, shape):
        """``(code − zero) · scale`` per row and group."""
        return decode_uniform(tensors, shape, self.config.bits, self.config.group_size)


class RoundToNearest(_Uniform):
    """Round-to-nearest (RTN) group quantization, the baseline of GPTQ's paper (Frantar et
    al. 2023, Table 1): per row and group of ``group_size`` columns, min-max asymmetric range
    (containing 0), ``q = clamp(round(w / s) + z, 0, 2^b − 1)``. Uses no data."""

    needs_hessian = False

    def compress(self, weight, hessian):
        """Quantize every group independently."""
        c = self.config
        out_f, in_f = weight.shape
        groups = math.ceil(in_f / c.group_size)
        codes = torch.empty(out_f, in_f)
        scales, zeros = torch.empty(out_f, groups), torch.empty(out_f, groups)
        for g in range(groups):
            cols = slice(g * c.group_size, min((g + 1) * c.group_size, in_f))
            s, z = minmax_params(weight[:, cols], c.bits)
            codes[:, cols] = quantize_uniform(weight[:, cols], c.bits, s, z)
            scales[:, g], zeros[:, g] = s[:, 0], z[:, 0]
        return self._result(codes, scales, zeros, (out_f, in_f))


class GPTQ(_Uniform):
    """GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
    Pre-trained Transformers", ICLR 2023), Algorithm 1: columns in their natural order (no act
    order), each quantized and its error ``(w − q) / [chol(H⁻¹)]_jj`` propagated to the later
    columns, lazily per block. A group's scale and zero point are computed from the *updated*
    weights when the sweep reaches the group's first column (the paper's grouping)."""

    def compress(self, weight, hessian):
        """Quantize column by column with error feedback."""
        c = self.config
        out_f, in_f = weight.shape
        h = damped(hessian, c.damp)
        w = weight.double().clone()
        w[:, torch.diagonal(hessian) <= 0] = 0.0
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
        groups = math.ceil(in_f / c.group_size)
        codes = torch.empty(out_f, in_f, dtype=torch.float64)
        scales = torch.empty(out_f, groups, dtype=torch.float64)
        zeros = torch.empty(out_f, groups, dtype=torch.float64)
        for i1 in range(0, in_f, c.block_size):
            i2 = min(i1 + c.block_size, in_f)
            w1, hinv1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
            err1 = torch.zeros_like(w1)
            for j in range(i2 - i1):
                col = i1 + j
                g = col // c.group_size
                if col % c.group_size == 0:
                    # the group's range from the current (updated) weights; they may lie in this
                    # block or beyond it (the later columns got this block's updates only so far)
                    end = min(col + c.group_size, in_f)
                    current = torch.cat([w1[:, j:], w[:, i2:end]], 1)[:, : end - col]
                    s, z = minmax_params(current.float(), c.bits)
                    scales[:, g], zeros[:, g] = s[:, 0].double(), z[:, 0].double()
                s, z = scales[:, g], zeros[:, g]
                q_code = torch.clamp(torch.round(w1[:, j] / s) + z, 0, 2 ** c.bits - 1)
                q = (q_code - z) * s
                codes[:, col] = q_code
                e = (w1[:, j] - q) / hinv1[j, j]
                w1[:, j:] -= e[:, None] * hinv1[j, j:][None, :]
                err1[:, j] = e
            w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
        return self._result(codes, scales.float(), zeros.float(), (out_f, in_f))
