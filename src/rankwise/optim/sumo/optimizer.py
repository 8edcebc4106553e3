"""SUMO: one momentum per matrix, in a gradient subspace, orthogonalized exactly."""
from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn

from rankwise.optim import lowbit, oja, projector
from rankwise.optim.common import MatrixAdamW, Place, decay_, param_groups, step_generator
from rankwise.optim.sumo.config import SumoConfig

_RTOL = 1e-12  # Gram eigenvalues below this fraction of the largest count as zero (sigma ratio 1e-6)


def polar_batch(ms: torch.Tensor) -> torch.Tensor:
    """Exact polar factors ``U V^T`` of a batch of matrices, from the small Gram matrix.

    For a wide ``M`` (``s x l``, ``s <= l``) with SVD ``U S V^T``, ``(M M^T)^{-1/2} M = U V^T``:
    the same matrix the SVD gives, computed from an ``s x s`` eigendecomposition of the Gram
    matrix (formed in float64, so singular values down to ~1e-8 of the largest are resolved)
    instead of a thin SVD of ``M``. Directions whose singular value is below ``1e-6`` of the
    largest are dropped (an SVD would keep them with arbitrary singular vectors). Tall matrices
    go through their transpose. One batched ``eigh`` serves every matrix of a shape.

    Args:
        ms: ``(b, p, q)``.

    Returns:
        ``(b, p, q)`` with every nonzero singular value equal to 1, in ``ms``'s dtype.
    """
    wide = ms.shape[-2] <= ms.shape[-1]
    x = (ms if wide else ms.transpose(-2, -1)).float()        # (b, s, l), s <= l
    x64 = x.double()
    evals, evecs = torch.linalg.eigh(x64 @ x64.transpose(-2, -1))   # (b, s), (b, s, s); ascending
    keep = evals > evals[..., -1:].clamp_min(0) * _RTOL
    inv_sqrt = torch.where(keep, evals.clamp_min(torch.finfo(torch.float64).tiny).rsqrt(),
                           torch.zeros_like(evals))
    w = (evecs * inv_sqrt.unsqueeze(-2)) @ evecs.transpose(-2, -1)  # (b, s, s): (M M^T)^{-1/2}
    out = w.float() @ x                                            # (b, s, l)
    return (out if wide else out.transpose(-2, -1)).to(ms.dtype)


def orthogonalize(m: torch.Tensor) -> torch.Tensor:
    """Return the polar factor ``U V^T`` of ``m = U S V^T`` (see :func:`polar_batch`).

    Args:
        m: A 2-D tensor.

    Returns:
        A tensor shaped like ``m`` whose nonzero singular values are all 1.
    """
    return polar_batch(m.unsqueeze(0))[0]


class SumoOptimizer(MatrixAdamW):
    """SUMO (Refael, Smorodinsky, Tirer, Lindenbaum; NeurIPS 2025, Algorithm 1).

    For each projected ``m x n`` matrix, every step:

    1. every ``K`` steps: new basis ``Q_t`` from the gradient (top-``r`` singular vectors, from
       the Gram matrix's eigendecomposition by default; the paper uses a randomized SVD) and
       moment transport ``M <- (Q_t^T Q_{t-1}) M`` ("moment subspace transformation"); with
       ``projector: oja`` the basis moves by one streaming block-Oja step every step instead
       (:func:`rankwise.optim.oja.track`) and the moment is transported every step;
    2. ``G_hat = Q_t^T G`` (or ``G Q_t``, whichever side is smaller - recorded in state);
    3. ``M <- mu M + G_hat`` (first moment only);
    4. ``O = U V^T`` of ``M = U S V^T`` - the exact orthogonalization the paper uses (not
       Newton-Schulz), computed from the ``r x r`` Gram matrix's eigendecomposition
       (:func:`polar_batch`): the same matrix as the SVD's ``U V^T``, in one batched call for
       every moment of a shape, about 4x cheaper than a thin SVD per matrix on CPU;
    5. ``W <- W (1 - lr wd) - lr * alpha * (Q_t O + S)``, ``alpha = scale`` for every matrix
       (the paper's uniform scale; ``scale_rule: rms`` uses ``scale * sqrt(m n / r)`` instead,
       which makes every matrix's update RMS ``scale`` - an orthonormal rank-``r`` update has
       Frobenius norm ``sqrt(r)`` - Moonlight's RMS matching, shape-dependent: 2x between
       1024 x 4096 and 1024 x 1024); ``S = 0`` unless ``residual``.

    Block 4 of the official README ("original space update: the orthogonal term of the gradient
    outside the low-rank subspace ... without extra memory"), ``residual: true``: ``S = phi (G -
    Q_t Q_t^T G)`` with ``phi = ||O||_F / ||Q_t^T G||_F``, so the residual is stepped at the rate
    the subspace part gets per unit of projected gradient; ``norm_growth: gamma`` limits it as
    Fira does (Chen et al. 2024): ``||S_t|| <= gamma ||S_{t-1}||`` (one 0-dim tensor of state).
    Its exact scaling is not in any text of the paper we could read (the README names the block,
    its formula is not there), so this is our reading, after Fira, which SUMO's README cites as
    its memory-free precedent; it is off by default. The limiter acts on ``S`` only: ``Q_t O``
    has the fixed norm ``sqrt(r)``. Matrices not projected (groups without ``rank``) use AdamW.

    State per projected matrix: ``momentum`` (``max(m,n) x r``) and ``proj_basis``
    (``min(m,n) x r``): ``nr + mr`` floats (+ the limiter's 0-dim ``residual_norm``).

    Param-group keys beyond AdamW's: ``rank`` (turns SUMO on for the group), ``update_every``,
    ``momentum``, ``scale``, ``scale_rule``, ``residual``, ``norm_growth``, ``svd``,
    ``projector``, ``oja_lr``, ``oja_bits``, ``seed``, ``state_bits`` (``8``: the momentum and the
    AdamW moments stored as blockwise 8-bit codes, :mod:`rankwise.optim.lowbit`).
    Constructor arguments are those of :class:`rankwise.optim.common.MatrixAdamW`.
    """

    group_defaults = dict(momentum=0.9, update_every=200, scale=5.0, scale_rule="uniform",
                          residual=False, norm_growth=None, svd="eigh", projector="svd",
                          oja_lr=1.0, oja_bits=None, seed=0)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[tuple] = []

    def matrix_step(self, param: torch.Tensor, state: dict, group: dict, step: int,
                    place: Place) -> None:
        """Steps 1-3 for one projected matrix; steps 4-5 run batched in :meth:`finish_step`.

        Arguments as :meth:`rankwise.optim.common.MatrixAdamW.matrix_step`.
        """
        grad = param.grad
        old, moved = None, False
        if group["projector"] == "oja":
            gen = step_generator(group["seed"], place.index, step) if group["oja_bits"] else None
            old = oja.track(state, grad, group["rank"], group["oja_lr"], group["oja_bits"], gen, group["svd"])
            moved = True
        elif "proj_side" not in state or (step - 1) % group["update_every"] == 0:
            old = projector.refresh(state, grad, group["rank"], "top", group["svd"])
            moved = True
        bits = group["state_bits"]
        mom = None if "momentum" not in state else (
            lowbit.load(state, "momentum", grad) if bits else state["momentum"])
        if moved and mom is not None:
            mom = projector.transport(state, old, mom)
        low = projector.project(state, grad)
        if mom is None:
            mom = torch.zeros_like(low)
        mom.mul_(group["momentum"]).add_(low)
        if not bits:
            state["momentum"] = mom
        rest = None
        if group["residual"] and int(state["proj_side"]) != projector.IDENTITY:
            rest = (grad - projector.project_back(state, low), float(low.norm()))   # (G - Q Q^T G, ||Q^T G||)
        self._pending.append((param, state, group, rest, mom))

    def finish_step(self) -> None:
        """Steps 4-5: orthogonalize every pending moment (one batch per shape) and update."""
        by_shape: dict[tuple, list] = defaultdict(list)
        for item in self._pending:
            mom = item[4]
            by_shape[(tuple(mom.shape), mom.dtype, mom.device)].append(item)
        self._pending = []
        for items in by_shape.values():
            polar = polar_batch(torch.stack([it[4] for it in items]))
            for (param, state, group, rest, mom), o in zip(items, polar):
                if group["state_bits"]:
                    lowbit.store(state, "momentum", mom)
                factor = group["scale"]
                if group["scale_rule"] == "rms":
                    factor *= math.sqrt(param.shape[0] * param.shape[1] / min(o.shape))
                decay_(param, group["lr"], group["weight_decay"])
                param.add_(projector.project_back(state, o), alpha=-group["lr"] * factor)
                if rest is not None:
                    param.add_(_residual_step(state, o, *rest, group["norm_growth"]),
                               alpha=-group["lr"] * factor)


def _residual_step(state: dict, o: torch.Tensor, rest: torch.Tensor, low_norm: float,
                   gamma: float | None) -> torch.Tensor:
    """Block 4's ``S = phi (G - Q Q^T G)``, ``phi = ||O||_F / ||Q^T G||_F``, limited to
    ``gamma`` times the previous step's norm (``residual_norm`` in ``state``) when ``gamma``."""
    s = rest * (float(o.norm()) / low_norm) if low_norm > 0 else torch.zeros_like(rest)
    if gamma is not None:
        norm = float(s.norm())
        prev = state.get("residual_norm")
        if prev is not None and norm > gamma * float(prev) and norm > 0:
            s = s * (gamma * float(prev) / norm)
            norm = gamma * float(prev)
        state["residual_norm"] = torch.tensor(norm)
    return s


def build_sumo(model: nn.Module, config: SumoConfig) -> SumoOptimizer:
    """Registry builder for ``sumo``: block matrices get SUMO, everything else AdamW.

    Args:
        model: The model to train.
        config: The ``optim:`` section.

    Returns:
        The optimizer over the trainable parameters.
    """
    groups = param_groups(model, config.targets, rank=config.rank, update_every=config.update_every,
                          momentum=config.momentum, scale=config.scale, scale_rule=config.scale_rule,
                          residual=config.residual, norm_growth=config.norm_growth, svd=config.svd,
                          projector=config.projector, oja_lr=config.oja_lr, oja_bits=config.oja_bits,
                          seed=config.seed)
    return SumoOptimizer(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                         weight_decay=config.weight_decay, state_bits=config.state_bits)
