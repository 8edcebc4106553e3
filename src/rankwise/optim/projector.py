"""The one subspace projector shared by every projected optimizer (GaLore, GaLore-IS, SUMO).

Everything the projector knows lives in the optimizer's per-parameter ``state`` as tensors, so
``optimizer.state_dict()`` saves it, ``torch.load(weights_only=True)`` reads it back, and a
resumed run continues bit for bit:

* ``proj_side`` - a 0-dim int tensor recording the orientation, decided once from the shape:
  ``LEFT`` (``R = Q^T G``, used when ``m < n``), ``RIGHT`` (``R = G Q``, used when ``m >= n``)
  or ``IDENTITY`` (the rank covers the smaller side, so no projection is needed and ``R = G``).
  Back-projection reads this flag; it never re-guesses the side from the shape of ``R`` (the
  bug GaLore's ``project_back`` has for square projected gradients).
* ``proj_basis`` - ``Q``, a ``(d, r)`` matrix with orthonormal columns, ``d = min(m, n)``.
  The smaller side is always the one compressed, so the projected gradient and every moment
  is ``max(m, n) x r`` and the basis is ``min(m, n) x r``: GaLore's ``2nr + mr`` accounting
  (Zhao et al. 2024, Sec. 4.1, ``m <= n``).

Ranks at or above ``min(m, n)`` switch to ``IDENTITY``: a full orthogonal basis would only rotate
the gradient, cost an SVD and ``d^2`` floats, and make Adam's element-wise second moment
basis-dependent; the identity makes the optimizer exactly its full-rank parent.

Two ways to keep the basis current: :func:`refresh` (an SVD of the gradient every ``T`` steps,
GaLore's) and :func:`rankwise.optim.oja.track` (a streaming block-Oja step every step). With
``oja_bits`` the tracked basis is stored as int8 codes (``proj_basis``) and one float scale
per column (``proj_scale``); :func:`basis` reads either form.
"""
from __future__ import annotations

import torch

LEFT, RIGHT, IDENTITY = 0, 1, 2


def choose_side(shape: torch.Size | tuple[int, int], rank: int) -> int:
    """Return the orientation for an ``m x n`` matrix at ``rank``.

    Args:
        shape: ``(m, n)``.
        rank: Requested rank.

    Returns:
        ``IDENTITY`` if ``rank >= min(m, n)``; else ``RIGHT`` for tall or square matrices
        (``m >= n``, compress the columns) and ``LEFT`` for wide ones.
    """
    m, n = shape
    if rank >= min(m, n):
        return IDENTITY
    return RIGHT if m >= n else LEFT


def _canonical_signs(q: torch.Tensor) -> torch.Tensor:
    """Flip each column so its largest-magnitude entry is positive (SVD signs are arbitrary;
    this makes the basis a deterministic function of the gradient on every process)."""
    idx = q.abs().argmax(dim=0, keepdim=True)  # (1, r)
    sign = torch.sign(q.gather(0, idx))
    sign[sign == 0] = 1
    return q * sign


def spectrum(a: torch.Tensor, method: str = "svd") -> tuple[torch.Tensor, torch.Tensor]:
    """Left singular vectors and values of ``a`` (``d x k`` with ``d <= k``), largest first.

    Args:
        a: The matrix, computed in float32 whatever its dtype.
        method: ``"svd"`` - ``torch.linalg.svd`` (exact, GaLore's choice); ``"eigh"`` -
            eigen-decomposition of the ``d x d`` Gram matrix ``a a^T`` (about 2-4x cheaper on
            CPU because the right vectors are never formed; singular values below
            ``sqrt(float32 eps) * s_max`` lose relative accuracy, which only matters for the
            tail of the spectrum).

    Returns:
        ``(U, s)`` with ``U`` of shape ``(d, d)`` and ``s`` of shape ``(d,)``, descending.
    """
    a = a.float()
    if method == "eigh":
        evals, evecs = torch.linalg.eigh(a @ a.T)  # ascending
        return evecs.flip(1), evals.flip(0).clamp_min(0).sqrt()
    u, s, _ = torch.linalg.svd(a, full_matrices=False)
    return u, s


def select_columns(s: torch.Tensor, rank: int, how: str,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices of the ``rank`` singular directions that span the subspace.

    Args:
        s: Singular values, descending.
        rank: How many to keep (``< len(s)``).
        how: ``"top"`` - the leading ``rank`` (GaLore); ``"sampled"`` - drawn without
            replacement with probability proportional to the singular values (importance
            sampling, Zhang et al. 2025; the reading of the rule is in
            :class:`rankwise.optim.galore.GaLoreAdamW`).
        generator: Random source for ``"sampled"``.

    Returns:
        Sorted ``int64`` indices, shape ``(rank,)``.
    """
    if how == "top" or not bool(s.sum() > 0):
        return torch.arange(rank)
    idx = torch.multinomial(s / s.sum(), rank, replacement=False, generator=generator)
    return idx.sort().values


def refresh(state: dict, grad: torch.Tensor, rank: int, how: str = "top", method: str = "svd",
            generator: torch.Generator | None = None) -> torch.Tensor | None:
    """(Re)compute the basis from ``grad`` and store it in ``state``.

    Args:
        state: The parameter's optimizer state; ``proj_side`` is set on first use.
        grad: The ``m x n`` gradient.
        rank: Subspace dimension.
        how: ``"top"`` or ``"sampled"`` (see :func:`select_columns`).
        method: ``"svd"`` or ``"eigh"`` (see :func:`spectrum`).
        generator: Random source for ``"sampled"``.

    Returns:
        The previous basis (``None`` on the first call or in ``IDENTITY`` mode), so callers
        such as SUMO can transport their moments into the new subspace.
    """
    if "proj_side" not in state:
        state["proj_side"] = torch.tensor(choose_side(grad.shape, rank), dtype=torch.int64)
    side = int(state["proj_side"])
    if side == IDENTITY:
        return None
    a = grad if side == LEFT else grad.T  # (d, k), d = min(m, n)
    u, s = spectrum(a, method)
    q = _canonical_signs(u[:, select_columns(s, rank, how, generator)]).to(grad.dtype)
    old = basis(state)
    state["proj_basis"] = q.contiguous()  # (d, r)
    return old


def basis(state: dict) -> torch.Tensor | None:
    """The ``(d, r)`` basis ``Q`` in floating point: ``proj_basis`` itself, or its int8 codes
    times the per-column ``proj_scale`` when the tracker is quantized (``None`` if absent)."""
    q = state.get("proj_basis")
    if q is None or "proj_scale" not in state:
        return q
    return q.to(state["proj_scale"].dtype) * state["proj_scale"]


def project(state: dict, grad: torch.Tensor) -> torch.Tensor:
    """Project an ``m x n`` gradient: ``Q^T G`` (LEFT, ``r x n``), ``G Q`` (RIGHT, ``m x r``)
    or ``G`` itself (IDENTITY)."""
    side = int(state["proj_side"])
    if side == IDENTITY:
        return grad
    q = basis(state)
    return q.T @ grad if side == LEFT else grad @ q


def project_back(state: dict, low: torch.Tensor) -> torch.Tensor:
    """Map a projected-space tensor back to ``m x n``: ``Q N`` (LEFT), ``N Q^T`` (RIGHT) or
    ``N`` (IDENTITY), using the recorded orientation."""
    side = int(state["proj_side"])
    if side == IDENTITY:
        return low
    q = basis(state)
    return q @ low if side == LEFT else low @ q.T


def transport(state: dict, old_basis: torch.Tensor | None, moment: torch.Tensor) -> torch.Tensor:
    """Express a projected-space moment, stored in ``old_basis`` coordinates, in the current
    basis: ``(Q_new^T Q_old) M`` (LEFT) or ``M (Q_old^T Q_new)`` (RIGHT).

    This is SUMO's "moment subspace transformation" (Refael et al. 2025, Alg. 1): the part of
    the moment inside the new subspace is kept, the rest is dropped.

    Args:
        state: Holds the new basis and the orientation.
        old_basis: The basis the moment was accumulated in (``None``: nothing to do).
        moment: ``r x n`` (LEFT) or ``m x r`` (RIGHT).

    Returns:
        The transported moment (same shape).
    """
    side = int(state["proj_side"])
    if old_basis is None or side == IDENTITY:
        return moment
    change = basis(state).T @ old_basis  # (r, r): new coordinates of old basis vectors
    return change @ moment if side == LEFT else moment @ change.T


def basis_numel(shape: tuple[int, int], rank: int, bits: int | None = None) -> float:
    """Floats (4-byte units) the basis needs for an ``m x n`` matrix: ``min(m, n) * r``, or 0
    in IDENTITY mode; with a quantized tracker (``bits``), one byte per entry plus one float
    scale per column, ``min(m, n) * r / 4 + r`` (may be fractional)."""
    if choose_side(shape, rank) == IDENTITY:
        return 0
    return min(shape) * rank / 4 + rank if bits else min(shape) * rank


def projected_numel(shape: tuple[int, int], rank: int) -> int:
    """Number of floats in a projected gradient (``max(m, n) * r``, or ``m * n`` for IDENTITY)."""
    m, n = shape
    return m * n if choose_side(shape, rank) == IDENTITY else max(m, n) * rank
