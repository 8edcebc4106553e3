"""Pruning baselines: magnitude, Wanda, SparseGPT (unstructured and N:M).

All three store a sparse matrix (:func:`rankwise.compress.formats.encode_sparse`) and meet the
configured pattern exactly (:mod:`rankwise.compress.pattern`).
"""
from __future__ import annotations

import torch

from rankwise.compress.base import Compressed, Compressor, damped
from rankwise.compress.formats import decode_sparse, encode_sparse
from rankwise.compress.pattern import keep_mask, kept


def sparse_result(weight: torch.Tensor, keep: torch.Tensor, nm: tuple[int, int] | None,
                  dtype: torch.dtype, **info) -> Compressed:
    """Encode ``weight`` restricted to ``keep`` and decode it back (the stored form).

    Args:
        weight: ``(out, in)`` values (entries outside ``keep`` are dropped).
        keep: Boolean mask of kept positions.
        nm: ``(N, M)`` or ``None``.
        dtype: Storage dtype of the values.
        **info: Extra report numbers.

    Returns:
        The :class:`Compressed` layer, with the achieved ``sparsity`` in ``info``.
    """
    tensors = encode_sparse(weight, keep, nm, dtype)
    dense = decode_sparse(tensors, tuple(weight.shape), nm)
    nnz = int(keep.sum())
    return Compressed(tensors, dense, nnz, {"sparsity": 1.0 - nnz / keep.numel(), **info})


class SparseCompressor(Compressor):
    """Shared decode of the pruning methods (their compact form is a sparse matrix)."""

    def decode(self, tensors, shape):
        """The sparse matrix, zeros elsewhere."""
        return decode_sparse(tensors, shape, self.config.nm)


class MagnitudePruning(SparseCompressor):
    """Magnitude pruning (Han et al., "Learning both Weights and Connections for Efficient
    Neural Networks", 2015; layer-wise as in Zhu & Gupta 2017): keep the largest ``|W_ij|``
    of the whole layer (unstructured) or of each run of M inputs (N:M). Uses no data."""

    needs_hessian = False

    def compress(self, weight, hessian):
        """Keep the largest magnitudes."""
        c = self.config
        keep = keep_mask(weight.abs(), c.sparsity, c.nm, group="layer")
        return sparse_result(weight, keep, c.nm, self.value_dtype)


class Wanda(SparseCompressor):
    """Wanda (Sun et al., "A Simple and Effective Pruning Approach for Large Language Models",
    ICLR 2024), Eq. 1: score ``S_ij = |W_ij| · ‖X_j‖₂`` compared within each output row
    (unstructured) or within each run of M inputs of a row (N:M); no weight update.

    ``‖X_j‖₂ = sqrt(n · H_jj)``; the constant ``n`` does not change the ranking.
    """

    def compress(self, weight, hessian):
        """Keep the highest ``|W| · ‖X_j‖`` per row."""
        c = self.config
        norms = torch.sqrt(torch.diagonal(hessian).clamp(min=0))
        keep = keep_mask(weight.abs() * norms[None, :], c.sparsity, c.nm, group="row")
        return sparse_result(weight, keep, c.nm, self.value_dtype)


class SparseGPT(SparseCompressor):
    """SparseGPT (Frantar & Alistarh, "SparseGPT: Massive Language Models Can Be Accurately
    Pruned in One-Shot", ICML 2023), Algorithm 1: columns are visited left to right; a pruned
    weight's error ``(w − 0) / [H⁻¹]_jj`` is spread over the not-yet-visited weights of its row
    through the upper Cholesky factor of ``H⁻¹`` (the OBS update), lazily per block.

    Mask selection (score ``w² / [chol(H⁻¹)]_jj²``): unstructured picks, per block of
    ``block_size`` columns, the lowest scores of the whole block (the paper's adaptive mask);
    the per-block counts are cumulative roundings, so the layer drops exactly
    ``round(sparsity · numel)`` entries. N:M picks the M − N lowest of each group of M when the
    sweep reaches the group's first column.
    """

    def compress(self, weight, hessian):
        """Prune with OBS weight updates."""
        c = self.config
        nm = c.nm
        out_f, in_f = weight.shape
        h = damped(hessian, c.damp)
        w = weight.double().clone()
        w[:, torch.diagonal(hessian) <= 0] = 0.0
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
        keep = torch.ones(out_f, in_f, dtype=torch.bool)
        for i1 in range(0, in_f, c.block_size):
            i2 = min(i1 + c.block_size, in_f)
            w1, hinv1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
            err1 = torch.zeros_like(w1)
            d = torch.diagonal(hinv1)
            if nm is None:   # adaptive mask of the block; cumulative rounding keeps the total exact
                drop = (out_f * i2 - kept(out_f * i2, c.sparsity)) - (out_f * i1 - kept(out_f * i1, c.sparsity))
                if drop:
                    scores = (w1 ** 2 / d[None, :] ** 2).reshape(-1)
                    low = torch.topk(scores, drop, largest=False, sorted=False).indices
                    block_keep = torch.ones(scores.numel(), dtype=torch.bool)
                    block_keep[low] = False
                    keep[:, i1:i2] = block_keep.reshape(out_f, i2 - i1)
            for j in range(i2 - i1):
                col = i1 + j
                if nm is not None and col % nm[1] == 0:
                    n, m = nm
                    s = w1[:, j:j + m] ** 2 / d[None, j:j + m] ** 2
                    low = torch.topk(s, m - n, dim=1, largest=False, sorted=False).indices
                    keep[:, col:col + m].scatter_(1, low, False)
                q = w1[:, j] * keep[:, col]
                e = (w1[:, j] - q) / d[j]
                w1[:, j:] -= e[:, None] * hinv1[j, j:][None, :]
                w1[:, j] = q
                err1[:, j] = e
            w[:, i1:i2] = w1
            w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
        return sparse_result(w.float(), keep, nm, self.value_dtype)
