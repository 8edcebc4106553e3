"""Sparsity patterns: which entries a score keeps, with exact counts.

Every pruning method here (and 3BASiL's sparse block) reduces to "keep the highest scores"
within some comparison group:

* ``layer``: one group, the whole matrix (magnitude pruning, 3BASiL's unstructured projection);
* ``row``: each output row keeps the same count (Wanda's per-output comparison);
* N:M: each run of M consecutive inputs of a row keeps exactly N.

The kept count is ``round((1 - sparsity) · size)`` of the group, so a pattern is met exactly,
not approximately.
"""
from __future__ import annotations

import torch


def kept(size: int, sparsity: float) -> int:
    """Entries a group of ``size`` keeps at ``sparsity``."""
    return int(round((1.0 - sparsity) * size))


def keep_mask(scores: torch.Tensor, sparsity: float, nm: tuple[int, int] | None,
              group: str = "layer") -> torch.Tensor:
    """Boolean ``(out, in)`` mask of the kept entries (highest scores win; ties by position).

    Args:
        scores: ``(out, in)`` importance (larger = keep).
        sparsity: Fraction to drop when ``nm`` is ``None``.
        nm: ``(N, M)``: keep exactly N of each M consecutive inputs per row.
        group: ``"layer"`` or ``"row"`` comparison group for unstructured sparsity.

    Returns:
        The mask.
    """
    out_f, in_f = scores.shape
    mask = torch.zeros(out_f, in_f, dtype=torch.bool)
    if nm is not None:
        n, m = nm
        grouped = scores.reshape(out_f, in_f // m, m)                     # (out, in/M, M)
        idx = torch.topk(grouped, n, dim=-1, sorted=False).indices
        return mask.reshape(out_f, in_f // m, m).scatter_(-1, idx, True).reshape(out_f, in_f)
    if group == "row":
        k = kept(in_f, sparsity)
        if k:
            mask.scatter_(1, torch.topk(scores, k, dim=1, sorted=False).indices, True)
        return mask
    k = kept(out_f * in_f, sparsity)
    if k:
        mask.view(-1)[torch.topk(scores.reshape(-1), k, sorted=False).indices] = True
    return mask


def check_pattern(weight: torch.Tensor, nm: tuple[int, int]) -> bool:
    """True if every run of M consecutive inputs of every row has at most N nonzeros."""
    n, m = nm
    out_f, in_f = weight.shape
    return bool(((weight.reshape(out_f, in_f // m, m) != 0).sum(-1) <= n).all())
