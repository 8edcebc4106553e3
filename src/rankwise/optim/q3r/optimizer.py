"""AdamW with the quadratic reweighted rank regularizer (Q3R) applied decoupled."""
from __future__ import annotations

import torch
from torch import nn

from rankwise.optim.common import (MatrixAdamW, Place, grouped_state_floats, param_groups,
                                   step_generator)
from rankwise.optim.q3r.config import Q3RConfig


def _svd_dtype(w: torch.Tensor) -> torch.Tensor:
    """``w`` in float32 at least (half precision has no LAPACK SVD; float64 stays float64)."""
    return w if w.dtype in (torch.float32, torch.float64) else w.float()


def target_rank(rank: float, shape: tuple[int, ...], scale: bool = True) -> int:
    """The rank ``r`` Q3R regularizes an ``m x n`` matrix to, read as the authors' code does
    (``Functions/Q3R.py``, ``target_ranks``): a fraction ``0 < rank < 1`` is
    ``int(rank * max(m, n))``; an integer is multiplied by the aspect ratio ``max / min``
    (``int(rank * max(m, n) / min(m, n))``) unless ``scale`` is false. At least 1.

    Args:
        rank: The configured ``rank``.
        shape: The matrix shape (the last two dimensions are used).
        scale: Multiply an integer rank by the aspect ratio.

    Returns:
        The per-matrix target rank.
    """
    m, n = shape[-2:]
    if rank < 1:
        return max(1, int(rank * max(m, n)))
    return max(1, int(rank * max(m, n) / min(m, n)) if scale else int(rank))


def _weights(top: torch.Tensor, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, s')``: how many leading directions lie above ``eps`` (the envelope rank, per
    matrix) and ``s'_i = eps / sigma_i - 1`` there, 0 elsewhere. ``eps`` broadcasts over ``top``
    (``(..., K)``) as a float or a ``(...,)`` tensor."""
    eps_t = torch.as_tensor(eps, dtype=top.dtype, device=top.device)
    eps_b = eps_t[..., None] if eps_t.dim() else eps_t
    above = top > eps_b
    return above.sum(-1), torch.where(above, eps_b / top.clamp_min(1e-30) - 1, torch.zeros_like(top))


def reweight(w: torch.Tensor, rank: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """One IRLS reweighting: SVD of the current weight and the new smoothing ``eps``.

    Every direction with ``sigma_i > eps`` gets the reduced weight ``eps / sigma_i``, not only
    the top ``r`` (the authors' ``update_weightoperator`` keeps the ``r(eps, W) = #{sigma_i >
    eps}`` leading triplets). As ``eps`` is a running minimum it soon lies below the current
    ``sigma_{r+1}``, and then this envelope is wider than ``r``.

    Args:
        w: The ``m x n`` weight.
        rank: Target rank ``r`` (``< min(m, n)``; see :func:`target_rank`).
        eps: Previous smoothing parameter (``inf`` at the start).

    The singular triplets come from a float64 eigen-decomposition of the ``min(m,n)``-sized Gram
    matrix (about 2x faster than a float32 SVD on CPU at 128x256; float64 keeps singular values
    down to ~1e-7 of the largest accurate, which the tail below ``eps`` does not need).

    Returns:
        ``(U, V, s_prime, eps)``: the leading ``k = max(r, #{sigma_i > eps})`` singular vectors
        (``m x k``, ``n x k``), ``s'_i = eps / sigma_i - 1`` where ``sigma_i > eps`` and 0
        elsewhere (shape ``(k,)``), and ``eps = min(eps, sigma_{r+1})`` (the authors' default,
        monotone schedule).
    """
    w64 = w.double()
    wide = w.shape[0] <= w.shape[1]
    gram = w64 @ w64.T if wide else w64.T @ w64           # (d, d), d = min(m, n)
    evals, evecs = torch.linalg.eigh(gram)                # ascending
    s = evals.flip(0).clamp_min(0).sqrt()
    eps = min(eps, float(s[rank]))
    k = max(rank, int(_weights(s, eps)[0]))
    side = evecs.flip(1)[:, :k]                           # top singular vectors of the small side
    other = (w64.T @ side if wide else w64 @ side) / s[:k].clamp_min(1e-30)
    u, v = (side, other) if wide else (other, side)
    s_prime = _weights(s[:k], eps)[1]
    return u.to(w.dtype), v.to(w.dtype), s_prime.to(w.dtype), eps


def reweight_tracked(w: torch.Tensor, rank: int, eps, warm: torch.Tensor, iters: int = 2,
                     oversample: int = 8, generator: torch.Generator | None = None):
    """One IRLS reweighting by warm-started subspace iteration instead of a full decomposition.

    The leading singular vectors of the smaller side are refined from the previous
    reweighting's (``warm``, plus ``oversample`` random columns that estimate the singular
    values just beyond them): ``iters`` steps of block power iteration ``Q <- qr(A A^T Q)`` and
    a Rayleigh-Ritz step (``eigh`` of the block's Gram matrix), all float32 matrix products,
    ``O(m n (k + p))`` per iteration. Between reweightings (5 steps) the weight moves little, so
    the basis carried from the previous call is already close: over training this is subspace
    iteration on a slowly varying matrix, with the exact decomposition as its fixed point.
    When every Ritz value of the block lies above the new ``eps`` (the envelope of
    :func:`reweight` may reach beyond it), the block grows by ``oversample`` columns and the
    iteration repeats, up to the whole space.
    Batched: ``w`` may be ``(b, m, n)`` with ``warm`` ``(b, d, k)`` and ``eps`` a ``(b,)`` tensor.

    Args:
        w: The ``m x n`` weight (or a batch of them).
        rank: Target rank ``r`` (``< min(m, n)``).
        eps: Previous smoothing parameter(s).
        warm: ``(min(m, n), k)``, ``k >= r``, leading singular vectors of the smaller side from
            the previous reweighting.
        iters: Power iterations.
        oversample: Extra random columns (so ``sigma_{r+1}`` is a Ritz value, not a guess).
        generator: Source of the random columns (seeded by step: identical on every process).

    Returns:
        As :func:`reweight`, with one width ``k`` for the whole batch (the largest envelope;
        ``s'`` is 0 beyond each matrix's own); ``eps`` a float for one matrix, a ``(b,)``
        tensor for a batch.
    """
    wide = w.shape[-2] <= w.shape[-1]
    a = (w if wide else w.mT).float()                     # (..., d, k), d = min(m, n)
    d = a.shape[-2]
    q = warm.to(a.dtype)
    while True:
        extra = min(oversample, d - q.shape[-1])
        noise = torch.randn(*q.shape[:-1], extra, generator=generator).to(device=a.device, dtype=a.dtype)
        q = torch.cat([q, noise], dim=-1)                 # (..., d, k + p); the QR below orthonormalizes
        for _ in range(iters):
            q = torch.linalg.qr(a @ (a.mT @ q))[0]
        b = a.mT @ q                                      # (..., n', k + p)
        evals, evecs = torch.linalg.eigh(b.mT @ b)        # Rayleigh-Ritz, ascending
        s = evals.flip(-1).clamp_min(0).sqrt()
        evecs = evecs.flip(-1)
        eps_t = torch.minimum(torch.as_tensor(eps, dtype=s.dtype, device=s.device), s[..., rank])
        count = _weights(s, eps_t)[0]
        if extra == 0 or int(count.max()) < q.shape[-1]:
            break
        q = q @ evecs                                     # every Ritz vector lies above eps: widen
    k = max(rank, int(count.max()))
    top_vecs = evecs[..., :k]
    side = q @ top_vecs                                   # (..., d, k)
    other = (b @ top_vecs) / s[..., None, :k].clamp_min(1e-30)   # (..., n', k)
    u, v = (side, other) if wide else (other, side)
    s_prime = _weights(s[..., :k], eps_t)[1]
    return u.to(w.dtype), v.to(w.dtype), s_prime.to(w.dtype), (eps_t if w.dim() == 3 else float(eps_t))


def q3r_operator(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor, s_prime: torch.Tensor) -> torch.Tensor:
    """The IRLS weight operator ``R(X) = X + U S' U^T X + X V S' V^T + U S' U^T X V S' V^T``.

    In the full singular bases of the reweighting point it multiplies coefficient ``(i, j)`` of
    ``X`` by ``s_i s_j`` with ``s_i = eps / max(sigma_i, eps)``, i.e. by
    ``H_ij = eps^2 / (max(sigma_i, eps) max(sigma_j, eps))`` (Q3R paper, Alg. 3-4). It is
    self-adjoint and costs four ``m x n x r`` products (:func:`_operator_factors`); every
    argument may carry a leading batch dimension.

    Args:
        x: ``m x n``.
        u: ``m x r`` left singular vectors of the reweighting point.
        v: ``n x r`` right singular vectors.
        s_prime: ``(r,)``, ``s_i - 1`` (0 for directions below ``eps``).

    Returns:
        ``R(X)``, ``m x n``.
    """
    left, right = _operator_factors(x, u, v, s_prime)
    return x + left @ right


def _operator_factors(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                      s_prime: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L, R)`` with ``R(X) = X + L R``: ``L = [U, (X V) S']`` (``m x 2r``),
    ``R = [S' U^T X + S' (U^T X V) S' V^T ; V^T]`` (``2r x n``) - the four correction terms of
    :func:`q3r_operator` in one ``m x 2r x n`` product."""
    a = u.mT @ x                                           # (r, n)
    b = x @ v                                              # (m, r)
    c = a @ v                                              # (r, r)
    sp = s_prime[..., :, None]
    top = sp * a + (sp * c * s_prime[..., None, :]) @ v.mT  # (r, n)
    return torch.cat([u, b * s_prime[..., None, :]], dim=-1), torch.cat([top, v.mT], dim=-2)


def q3r_value(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor, s_prime: torch.Tensor) -> torch.Tensor:
    """Penalty ``<X, R(X)>`` (the authors' code; its gradient is ``2 R(X)``).

    Args:
        x, u, v, s_prime: As :func:`q3r_operator`.

    Returns:
        A 0-dim tensor.
    """
    return (x * q3r_operator(x, u, v, s_prime)).sum()


class Q3RAdamW(MatrixAdamW):
    """AdamW plus Q3R, the quadratic reweighted rank regularizer (Ghosh, Nguyen, Kuemmerle;
    NeurIPS 2025; the authors' ``AdamQ3R``).

    Per step, for regularized matrices (those whose :func:`target_rank` ``r`` is below
    ``min(m, n)``): the decoupled regularizer step
    ``W <- W - lr * lam * 2 R(W)`` with ``R`` from :func:`q3r_operator` at the current weight,
    then AdamW on the loss gradient (every parameter, with torch's multi-tensor kernels).
    Matrices of one shape are reweighted and regularized in one batch (:meth:`finish_step`). ``lam <X, R(X)>`` is a quadratic
    majorizer (at the last reweighting point) of a smoothed log-det rank surrogate; every
    ``update_every`` steps the point moves to the current weight and ``eps`` decreases to
    ``sigma_{r+1}`` (a running minimum), and every direction with ``sigma_i > eps`` gets the
    weight ``eps / sigma_i`` (the authors' ``update_weightoperator``), so weight mass below
    ``eps`` is pushed toward zero while the directions above it are barely penalised. Choices: the regularizer gradient is applied decoupled (not
    through Adam's preconditioner) and with the plain ``lr`` (the authors' current code; an
    earlier commit used ``3 lr``); it is applied before AdamW's decoupled decay, which therefore
    scales it by ``1 - lr wd`` (a second-order difference from applying it after); only the
    default ``eps`` schedule is implemented. Reweighting: the first one is an exact float64
    eigendecomposition (:func:`reweight`); later ones refine the previous singular vectors by
    warm-started subspace iteration (:func:`reweight_tracked`, ``reweight: "subspace"``, the
    default) or repeat the exact decomposition (``reweight: "eigh"``).

    After training, call :func:`rankwise.optim.q3r.truncate_to_factorized` to replace each
    regularized layer by its rank-``r`` factors.

    State per regularized ``m x n`` matrix: Adam's ``exp_avg``, ``exp_avg_sq`` (``m x n``) and
    ``q3r_u`` (``m x k``), ``q3r_v`` (``n x k``), ``q3r_weights`` (``k``), ``q3r_eps`` (0-dim),
    ``k >= r`` the directions above ``eps`` at the last reweighting.

    Param-group keys beyond AdamW's: ``rank`` (turns Q3R on for the group; read per matrix by
    :func:`target_rank`), ``scale_rank``, ``update_every``, ``lam``, ``reweight``,
    ``power_iters``. Constructor arguments are those of
    :class:`rankwise.optim.common.MatrixAdamW`.
    """

    def keeps_full_rank(self, group: dict, p: torch.Tensor) -> bool:
        """Whether Q3R's per-matrix rank (:func:`target_rank`) covers ``p``'s smaller side."""
        return (self.updates_own_way(group, p)
                and target_rank(group["rank"], tuple(p.shape), group["scale_rank"]) >= min(p.shape))

    group_defaults = dict(update_every=5, lam=0.1, reweight="subspace", power_iters=1, scale_rank=True)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[tuple[torch.Tensor, dict, dict, int, Place]] = []
        self._stacked: dict[tuple, tuple] = {}   # batch -> (its states' tensors, stacked U, V, S')

    def matrix_step(self, param: torch.Tensor, state: dict, group: dict, step: int,
                    place: Place) -> None:
        """Queue the matrix: its reweighting (when due) and regularizer step run batched by
        shape in :meth:`finish_step`, then AdamW (multi-tensor) as for every parameter.

        Arguments as :meth:`rankwise.optim.common.MatrixAdamW.matrix_step`.
        """
        if target_rank(group["rank"], param.shape, group["scale_rank"]) < min(param.shape) and group["lam"] > 0:
            self._pending.append((param, state, group, step, place))
        self.defer_adamw(param, state, group, step)

    def finish_step(self) -> None:
        """Reweight (when due) and apply ``W <- W - lr lam 2 R(W)`` to every queued matrix,
        one batch per (shape, group): a few batched products instead of a dozen small ones per
        matrix (on CPU most of the time of small matrices is spent launching operations)."""
        batches: dict[tuple, list] = {}
        for item in self._pending:
            param, _, group, step, _ = item
            due = (step - 1) % group["update_every"] == 0
            batches.setdefault((tuple(param.shape), param.dtype, id(group), due), []).append(item)
        self._pending = []
        for (_, _, _, due), items in batches.items():
            group = items[0][2]
            w = torch.stack([it[0] for it in items])                       # (b, m, n)
            if due:
                self._reweight(w, items, group)
            left, right = _operator_factors(w, *self._stacked_point([it[1] for it in items]))
            coeff = group["lr"] * group["lam"] * 2
            torch.baddbmm(w, left, right, beta=1 - coeff, alpha=-coeff, out=w)   # W - coeff R(W)
            torch._foreach_copy_([it[0] for it in items], list(w.unbind(0)))

    def _stacked_point(self, states: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(U, V, S')`` of a batch stacked, reused until a reweighting (or a loaded state)
        replaces the tensors (the cache keeps them alive, so their ids identify them). Widths
        differ between matrices (each keeps its directions above ``eps``): narrower ones are
        padded with zero columns and ``s' = 0``, which leave ``R`` unchanged."""
        tensors = tuple(st[k] for st in states for k in ("q3r_u", "q3r_v", "q3r_weights"))
        key = tuple(id(t) for t in tensors)
        if key not in self._stacked:
            if len(self._stacked) > 64:
                self._stacked.clear()
            width = max(st["q3r_weights"].shape[-1] for st in states)
            self._stacked[key] = (tensors, *(torch.stack([_pad(st[k], width) for st in states])
                                             for k in ("q3r_u", "q3r_v", "q3r_weights")))
        return self._stacked[key][1:]

    @staticmethod
    def _reweight(w: torch.Tensor, items: list, group: dict) -> None:
        """New reweighting points for a batch of equal-shaped matrices (see the class docstring)."""
        rank = target_rank(group["rank"], w.shape, group["scale_rank"])
        states = [it[1] for it in items]
        fresh = [i for i, st in enumerate(states) if "q3r_u" not in st or group["reweight"] == "eigh"]
        for i in fresh:                                                    # exact: first time, or "eigh"
            st = states[i]
            prev = float(st["q3r_eps"]) if "q3r_eps" in st else float("inf")
            u, v, sp, eps = reweight(w[i], rank, prev)
            st.update(q3r_u=u, q3r_v=v, q3r_weights=sp, q3r_eps=torch.tensor(eps))
        rest = [i for i in range(len(states)) if i not in fresh]
        if not rest:
            return
        wide = w.shape[-2] <= w.shape[-1]
        _, _, _, step, place = items[rest[0]]
        gen = step_generator(0, place.index, step)
        warm = [states[i]["q3r_u"] if wide else states[i]["q3r_v"] for i in rest]
        width = max(t.shape[-1] for t in warm)                             # pad with random columns
        warm = torch.stack([torch.cat([t, torch.randn(t.shape[0], width - t.shape[-1], generator=gen)
                                       .to(t)], dim=-1) for t in warm])
        prev = torch.stack([states[i]["q3r_eps"] for i in rest]).to(w.dtype)
        u, v, sp, eps = reweight_tracked(w[rest], rank, prev, warm, group["power_iters"], generator=gen)
        for j, i in enumerate(rest):
            states[i].update(q3r_u=u[j], q3r_v=v[j], q3r_weights=sp[j], q3r_eps=eps[j].clone().float())


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` with zero columns appended along its last dimension up to ``width``."""
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def build_q3r(model: nn.Module, config: Q3RConfig) -> Q3RAdamW:
    """Registry builder for ``q3r``: block matrices regularized, everything on AdamW.

    Args:
        model: The model to train.
        config: The ``optim:`` section.

    Returns:
        The optimizer over the trainable parameters.
    """
    groups = param_groups(model, config.targets, rank=config.rank, scale_rank=config.scale_rank,
                          update_every=config.update_every, lam=config.lam,
                          reweight=config.reweight, power_iters=config.power_iters)
    return Q3RAdamW(groups, lr=config.lr, betas=config.betas,
                    eps=config.eps, weight_decay=config.weight_decay)


def q3r_state_floats(model: nn.Module, config: Q3RConfig) -> int:
    """Q3R's state for ``model``: ``2mn + (m+n) r + r`` per regularized matrix (Adam's moments,
    ``U``, ``V`` and the weights at the least width ``k = r``, ``r`` from :func:`target_rank`;
    ``k`` grows with the directions above ``eps``), AdamW's ``2mn`` where ``r >= min(m, n)`` or
    ``lam = 0`` and 2 per element of the other parameters.

    Args:
        model: The model.
        config: Supplies ``rank``, ``lam`` and ``targets``.

    Returns:
        The number of state floats.
    """
    def per_matrix(shape: tuple[int, int]) -> int:
        m, n = shape
        r = target_rank(config.rank, shape, config.scale_rank)
        regularized = r < min(m, n) and config.lam > 0
        return 2 * m * n + ((m + n) * r + r if regularized else 0)

    return grouped_state_floats(model, config.targets, per_matrix)
