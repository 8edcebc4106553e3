"""GaLore-style AdamW: Adam moments in a low-rank subspace of each weight gradient."""
from __future__ import annotations

import torch
from torch import nn

from rankwise.optim import oja, projector
from rankwise.optim.common import MatrixAdamW, Place, decay_, param_groups, step_generator
from rankwise.optim.lowbit import quantized_adam_direction
from rankwise.optim.galore.config import GaLoreConfig

sample_generator = step_generator  # the name this module used before the helper moved to common


class GaLoreAdamW(MatrixAdamW):
    """AdamW whose moments for selected matrices live in a rank-``r`` gradient subspace.

    GaLore (Zhao et al., ICML 2024, Algorithm 2): every ``T`` steps ``P`` is taken from the SVD
    of the current gradient ``G_t``; ``R_t = P^T G_t``; Adam's moments are updated with
    ``R_t``; the weight moves by ``-lr * alpha * P N_t`` with ``N_t = M_t / (sqrt(V_t) + eps)``.
    Moments are reused unchanged across a subspace change, as in the paper's code.

    With ``select="sampled"`` this is the importance-sampling variant of Zhang et al.
    (NeurIPS 2025, "Breaking the Frozen Subspace"): the ``r`` singular directions are drawn
    without replacement with probability proportional to their singular values instead of
    always taking the top ``r``. The paper's algorithm text was not available to us; our
    reading (from its abstract and reviewer summaries) is: plain sampling, no rescaling of the
    projected gradient, moments kept across refreshes as in GaLore.

    Param-group keys (a group without ``rank`` is plain AdamW):
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        rank: subspace dimension (``>= min(m, n)`` means no projection for that matrix).
        update_every: refresh period ``T``.
        scale: ``alpha`` applied to the back-projected update.
        select: ``"top"`` or ``"sampled"``.
        svd: ``"svd"`` or ``"eigh"`` (see :func:`rankwise.optim.projector.spectrum`).
        stagger: spread refreshes of different matrices over the period.
        seed: seed of the sampling and of the Oja tracker's stochastic rounding.
        projector: ``"svd"`` (refresh every ``T`` steps) or ``"oja"`` (:func:`rankwise.optim.oja.track`
            every step: streaming block-Oja with QR, Dasgupta et al. 2025, our block reading).
        oja_lr, oja_bits: the Oja step and the tracker's bits (``None``: float).
        state_bits: ``8`` stores ``exp_avg``/``exp_avg_sq`` (projected or not) as blockwise
            8-bit codes plus one float32 maximum per 256 elements (GaLore's 8-bit variant,
            :mod:`rankwise.optim.lowbit`); ``None``: float32.

    State per projected matrix (all tensors): ``exp_avg``, ``exp_avg_sq`` (``max(m,n) x r``),
    ``proj_basis`` (``min(m,n) x r``), ``proj_side`` and ``step`` (0-dim): ``2nr + mr`` floats.

    Constructor arguments and the plain-group AdamW are those of
    :class:`rankwise.optim.common.MatrixAdamW`.
    """

    group_defaults = dict(update_every=200, scale=1.0, select="top", svd="svd", stagger=False, seed=0,
                          projector="svd", oja_lr=1.0, oja_bits=None)

    def matrix_step(self, param: torch.Tensor, state: dict, group: dict, step: int,
                    place: Place) -> None:
        """Refresh ``P`` when due (or move it one Oja step), then
        ``W <- W (1 - lr wd) - lr alpha P N`` (Algorithm 2).

        Arguments as :meth:`rankwise.optim.common.MatrixAdamW.matrix_step`.
        """
        grad = param.grad
        period = group["update_every"]
        phase = (place.matrix * period // place.matrices) if group["stagger"] else 0
        if group["projector"] == "oja":
            gen = step_generator(group["seed"], place.index, step) if group["oja_bits"] else None
            oja.track(state, grad, group["rank"], group["oja_lr"], group["oja_bits"], gen, group["svd"])
        elif "proj_side" not in state or (step - 1 + phase) % period == 0:
            gen = (sample_generator(group["seed"], place.index, step)
                   if group["select"] == "sampled" else None)
            projector.refresh(state, grad, group["rank"], group["select"], group["svd"], gen)
        low = projector.project(state, grad)  # (max(m,n), r) or (r, max(m,n))
        beta1, beta2 = group["betas"]
        direction = quantized_adam_direction(state, low, beta1, beta2, group["eps"], step,
                                             group["state_bits"])
        decay_(param, group["lr"], group["weight_decay"])
        param.add_(projector.project_back(state, direction), alpha=-group["lr"] * group["scale"])


def galore_param_groups(model: nn.Module, config: GaLoreConfig) -> list[dict]:
    """Return ``[plain group, projected group]`` for ``model`` under ``config``.

    Args:
        model: The model; only trainable parameters are used.
        config: Supplies rank, period, scale, selection and target patterns.

    Returns:
        Param-group dicts for :class:`GaLoreAdamW` (empty groups are dropped).
    """
    return param_groups(model, config.targets, rank=config.rank, update_every=config.update_every,
                        scale=config.scale, select=config.select, svd=config.svd,
                        stagger=config.stagger, seed=config.seed, projector=config.projector,
                        oja_lr=config.oja_lr, oja_bits=config.oja_bits)


def build_galore(model: nn.Module, config: GaLoreConfig) -> GaLoreAdamW:
    """Registry builder for ``galore`` and ``galore-is``.

    Args:
        model: The model to train.
        config: The ``optim:`` section.

    Returns:
        The optimizer over the trainable parameters: block matrices projected, the rest AdamW.
    """
    return GaLoreAdamW(galore_param_groups(model, config), lr=config.lr, betas=config.betas,
                       eps=config.eps, weight_decay=config.weight_decay, state_bits=config.state_bits)
