"""SUMO: one momentum per matrix, in a gradient subspace, orthogonalized by an exact SVD."""
from __future__ import annotations

import math
import torch
from torch import nn

from rankwise.optim import projector
from rankwise.optim.common import MatrixAdamW, Place, decay_, param_groups
from rankwise.optim.sumo.config import SumoConfig


def orthogonalize(m: torch.Tensor) -> torch.Tensor:
    """Return ``U V^T`` from the exact thin SVD ``m = U S V^T`` (the polar factor of ``m``).

    Args:
        m: A 2-D tensor.

    Returns:
        A tensor shaped like ``m`` whose nonzero singular values are all 1.
    """
    u, _, vh = torch.linalg.svd(m.float(), full_matrices=False)
    return (u @ vh).to(m.dtype)


class SumoOptimizer(MatrixAdamW):
    """SUMO (Refael, Smorodinsky, Tirer, Lindenbaum; NeurIPS 2025, Algorithm 1).

    For each projected ``m x n`` matrix, every step:

    1. every ``K`` steps: new basis ``Q_t`` from the gradient (top-``r`` singular vectors) and
       moment transport ``M <- (Q_t^T Q_{t-1}) M`` ("moment subspace transformation");
    2. ``G_hat = Q_t^T G`` (or ``G Q_t``, whichever side is smaller - recorded in state);
    3. ``M <- mu M + G_hat`` (first moment only);
    4. ``O = U V^T`` from the exact SVD of ``M`` (not Newton-Schulz);
    5. ``W <- W (1 - lr wd) - lr * scale * sqrt(m n / r) * Q_t O``.

    Choices where the paper's text was not available to us: the step-5 factor
    ``sqrt(m n / r)`` makes the RMS of the full-size update equal to ``scale`` (an orthonormal
    rank-``r`` update has Frobenius norm ``sqrt(r)``), the RMS-matching rule of Moonlight (Liu et
    al. 2025) so AdamW learning rates carry over; the optional "original space" residual term and
    norm-growth limiter of the official code are not implemented. Matrices not projected
    (groups without ``rank``) use AdamW.

    State per projected matrix: ``momentum`` (``max(m,n) x r``) and ``proj_basis``
    (``min(m,n) x r``): ``nr + mr`` floats.

    Param-group keys beyond AdamW's: ``rank`` (turns SUMO on for the group), ``update_every``,
    ``momentum``, ``scale``, ``svd``. Constructor arguments are those of
    :class:`rankwise.optim.common.MatrixAdamW`.
    """

    group_defaults = dict(momentum=0.9, update_every=200, scale=0.2, svd="svd")

    def matrix_step(self, param: torch.Tensor, state: dict, group: dict, step: int,
                    place: Place) -> None:
        """Steps 1-5 above for one projected matrix.

        Arguments as :meth:`rankwise.optim.common.MatrixAdamW.matrix_step`.
        """
        grad = param.grad
        if "proj_side" not in state or (step - 1) % group["update_every"] == 0:
            old = projector.refresh(state, grad, group["rank"], "top", group["svd"])
            if "momentum" in state:
                state["momentum"] = projector.transport(state, old, state["momentum"])
        low = projector.project(state, grad)
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(low)
        mom = state["momentum"].mul_(group["momentum"]).add_(low)
        r = min(low.shape)
        factor = group["scale"] * math.sqrt(param.shape[0] * param.shape[1] / r)
        decay_(param, group["lr"], group["weight_decay"])
        param.add_(projector.project_back(state, orthogonalize(mom)), alpha=-group["lr"] * factor)


def build_sumo(model: nn.Module, config: SumoConfig) -> SumoOptimizer:
    """Registry builder for ``sumo``: block matrices get SUMO, everything else AdamW.

    Args:
        model: The model to train.
        config: The ``optim:`` section.

    Returns:
        The optimizer over the trainable parameters.
    """
    groups = param_groups(model, config.targets, rank=config.rank, update_every=config.update_every,
                          momentum=config.momentum, scale=config.scale, svd=config.svd)
    return SumoOptimizer(groups, lr=config.lr, betas=config.betas,
                         eps=config.eps, weight_decay=config.weight_decay)
