"""GoRA's per-layer importance and rank allocation under a fixed parameter budget.

Pure functions over tensors and dicts, so they can be tested on hand-made numbers.
"""
from __future__ import annotations

import math

import torch

from rankwise.errors import RankwiseError


def _log_sv(m: torch.Tensor, k: int) -> float:
    sv = torch.linalg.svdvals(m.double())[:k]  # descending
    return float(torch.log1p(sv).sum())


def importance(kind: str, weight: torch.Tensor, grad: torch.Tensor, r0: int) -> float:
    """Return one layer's importance from its weight and averaged gradient.

    Args:
        kind: One of ``GoraConfig.importance``'s values (see there for the formulas).
        weight: The base weight W (any layout; G must have the same one).
        grad: The averaged gradient G of the loss with respect to W.
        r0: The reference rank (the ``*_log_sv`` kinds sum the top ``4 * r0`` singular values).

    Returns:
        A non-negative float.

    Raises:
        RankwiseError: On an unknown ``kind``.
    """
    w, g = weight.detach().float(), grad.detach().float()
    if kind == "union_mean":
        return float((w * g).abs().mean())
    if kind == "union_frobenius":
        return float(torch.linalg.matrix_norm(w * g))
    if kind == "grad_nuclear":
        return float(torch.linalg.svdvals(g.double()).sum())
    if kind == "grad_log_sv":
        return _log_sv(g, 4 * r0)
    if kind == "union_log_sv":
        return _log_sv(w * g, 4 * r0)
    raise RankwiseError(f"GoRA importance: got {kind!r}; expected union_mean, union_frobenius, "
                        "grad_nuclear, grad_log_sv or union_log_sv")


def normalise(scores: dict[str, float], sqrt: bool = False,
              temperature: float | None = None) -> dict[str, float]:
    """Turn raw importances into shares that sum to 1.

    Args:
        scores: ``{path: importance}``.
        sqrt: Take sqrt(I) first.
        temperature: If set, softmax(((I - min)/(max - min)) / T); else I / sum(I).

    Returns:
        ``{path: share}``; uniform shares when every importance is 0 (or all are equal under
        the softmax).
    """
    vals = {p: math.sqrt(max(v, 0.0)) if sqrt else max(v, 0.0) for p, v in scores.items()}
    n = len(vals)
    if temperature is not None:
        lo, hi = min(vals.values()), max(vals.values())
        span = hi - lo
        z = {p: ((v - lo) / span if span > 0 else 0.0) / temperature for p, v in vals.items()}
        top = max(z.values())
        e = {p: math.exp(v - top) for p, v in z.items()}
        tot = sum(e.values())
        return {p: v / tot for p, v in e.items()}
    tot = sum(vals.values())
    if tot <= 0:
        return {p: 1.0 / n for p in vals}
    return {p: v / tot for p, v in vals.items()}


def _water_fill(budget: float, shares: dict[str, float], cost: dict[str, int],
                lo: dict[str, int], hi: dict[str, int]) -> dict[str, float]:
    """Real-valued ranks x_W = R * share_W / cost_W, clamped to [lo, hi], budget re-spread."""
    fixed: dict[str, float] = {}
    while True:
        free = [p for p in shares if p not in fixed]
        if not free:
            return fixed
        rest = budget - sum(cost[p] * fixed[p] for p in fixed)
        tot = sum(shares[p] for p in free)
        x = {p: (rest * shares[p] / tot if tot > 0 else rest / len(free)) / cost[p] for p in free}
        over = {p for p in free if x[p] > hi[p]}
        under = {p for p in free if x[p] < lo[p]}
        if not over and not under:
            return {**fixed, **x}
        # Fix the side that is violated by more budget first; the other may resolve itself.
        excess = sum(cost[p] * (x[p] - hi[p]) for p in over)
        deficit = sum(cost[p] * (lo[p] - x[p]) for p in under)
        if excess >= deficit:
            fixed.update({p: float(hi[p]) for p in over})
        else:
            fixed.update({p: float(lo[p]) for p in under})


def allocate_ranks(shares: dict[str, float], dims: dict[str, tuple[int, int]], r0: int,
                   r_min: int, r_max: int, method: str = "largest_remainder") -> dict[str, int]:
    """Allocate integer ranks under GoRA's budget b = sum_W (m_W + n_W) * r0.

    Implements step 2 of GoRA (the paper's rank allocation, r_W ∝ b * I_W / (m_W + n_W)).

    Args:
        shares: ``{path: normalised importance}`` summing to 1 (see :func:`normalise`).
        dims: ``{path: (out_features, in_features)}``.
        r0: Reference rank.
        r_min: Lower clamp (0 allows skipping a layer).
        r_max: Upper clamp (also capped at min(m, n) per layer).
        method: ``largest_remainder``: water-fill the clamped budget, floor, then add one rank
            to the layers with the largest remainders while the budget allows, so
            |b - sum (m+n) r| < max(m+n) whenever the clamps leave the budget reachable;
            ``round``: the released code's clamp(round(b * share / (m + n))).

    Returns:
        ``{path: rank}``.

    Raises:
        RankwiseError: On an unknown method.
    """
    cost = {p: dims[p][0] + dims[p][1] for p in shares}
    hi = {p: min(r_max, min(dims[p])) for p in shares}
    lo = {p: min(r_min, hi[p]) for p in shares}
    budget = float(sum(c * r0 for c in cost.values()))
    if method == "round":
        return {p: int(min(hi[p], max(lo[p], round(budget * shares[p] / cost[p])))) for p in shares}
    if method != "largest_remainder":
        raise RankwiseError(f"GoRA allocation: got {method!r}; expected largest_remainder or round")
    x = _water_fill(budget, shares, cost, lo, hi)
    ranks = {p: min(hi[p], max(lo[p], int(math.floor(x[p] + 1e-9)))) for p in shares}
    left = budget - sum(cost[p] * ranks[p] for p in shares)
    for p in sorted(shares, key=lambda q: (x[q] - math.floor(x[q] + 1e-9), shares[q]), reverse=True):
        if ranks[p] < hi[p] and cost[p] <= left + 1e-9:
            ranks[p] += 1
            left -= cost[p]
    return ranks
