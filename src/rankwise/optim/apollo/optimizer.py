"""APOLLO / APOLLO-Mini: AdamW's moments of a random projection scale the raw gradient."""
from __future__ import annotations

import math

import torch
from torch import nn

from rankwise.optim import projector
from rankwise.optim.apollo.config import ApolloConfig
from rankwise.optim.common import MatrixAdamW, Place, decay_, grouped_state_floats, param_groups
from rankwise.optim.lowbit import moment_floats, quantized_adam_direction


def random_basis(d: int, rank: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The ``(d, r)`` random projection of one matrix and period: entries ``N(0, 1/r)``.

    It is a function of ``seed`` alone, so it is redrawn each step instead of stored (the state
    holds only the projected moments), and is identical on every DDP process and after a resume.

    Args:
        d: ``min(m, n)``, the side that is compressed.
        rank: ``r``.
        seed: From the group's seed, the parameter's index and the period (see :meth:`ApolloAdamW.seed_of`).
        device, dtype: Where and in which float type.

    Returns:
        ``(d, r)``.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(d, rank, generator=gen, device=device, dtype=dtype) / math.sqrt(rank)


class ApolloAdamW(MatrixAdamW):
    """APOLLO (Zhu, Zhang, Cong, Liu, Park, Chandra, Long, Pan, Wang, Lee; MLSys 2025, "APOLLO:
    SGD-like Memory, AdamW-level Performance", Algorithm 1), and APOLLO-Mini (rank 1, tensor-wise).

    For each projected ``m x n`` matrix with gradient ``G`` (``d = min(m, n)`` compressed, like
    GaLore; ``c = max(m, n)`` channels):

    1. ``P`` (``d x r``, entries ``N(0, 1/r)``) is drawn from a seed every ``T`` steps; no SVD;
    2. ``R = P^T G`` (``r x n``, when ``m < n``) or ``R = G P`` (``m x r``);
    3. AdamW's moments of ``R``: ``M <- b1 M + (1-b1) R``, ``V <- b2 V + (1-b2) R^2``,
       ``R~ = M^ / (sqrt(V^) + eps)`` (bias-corrected; moments kept across redraws, as the
       authors' code);
    4. scaling factor ``s = ||R~||/||R||``: per channel (column of ``R`` for ``m < n``, row for
       ``m >= n``; APOLLO) or per tensor (Frobenius norms; APOLLO-Mini);
    5. ``G~ = G diag(s)`` (the *raw* gradient scaled, not a back-projection), limited by Fira's
       norm-growth limiter: if ``||G~_t|| > gamma ||G~_{t-1}||`` it is rescaled to
       ``gamma ||G~_{t-1}||`` (``norm_growth``; the kept norm is the limited one). As in the
       authors' code the norms compared leave out Adam's bias correction
       ``c_t = sqrt(1 - b2^t) / (1 - b1^t)``, so the limiter does not fight the warm-up of
       ``c_t`` (measured: limiting the corrected norms instead changes the update by ~10%);
    6. ``W <- W (1 - lr wd) - lr alpha G~`` with ``alpha = sqrt(scale)`` (the authors' ``scale``
       argument; their code multiplies by its square root, after the limiter).

    Read from the authors' package ``apollo-torch`` (1.0.3) and the paper's summaries; two choices
    of ours: ``eps`` sits after bias correction (as ``torch.optim.AdamW``; the package adds it to
    ``sqrt(V)`` before) and weight decay is applied before the update (the package: after it);
    both differ by ``O(eps)`` / ``O(lr^2 wd)``. A zero channel ``||R_j|| = 0`` gets ``s_j = 0``
    (the package adds ``1e-8`` to every denominator). Ranks ``>= min(m, n)`` use AdamW for the
    matrix (the package would still project).

    State per projected matrix: ``exp_avg``, ``exp_avg_sq`` (``c x r``): ``2 c r`` floats, plus
    the limiter's 0-dim ``scaled_norm`` and ``step``; the projection is regenerated from its seed,
    never stored (the package keeps it: ``+ d r``). With ``state_bits: 8`` the moments are
    blockwise 8-bit (:mod:`rankwise.optim.lowbit`).

    Param-group keys beyond AdamW's: ``rank`` (turns APOLLO on for the group), ``update_every``,
    ``scale``, ``scale_type`` (``"channel"``/``"tensor"``), ``norm_growth`` (``None``: off),
    ``seed``, ``state_bits``. Constructor arguments are those of :class:`MatrixAdamW`.
    """

    group_defaults = dict(update_every=200, scale=1.0, scale_type="channel", norm_growth=1.01, seed=0)

    @staticmethod
    def seed_of(seed: int, index: int, period: int) -> int:
        """Seed of the projection of parameter ``index`` in period ``period`` (0-based)."""
        return (seed * 1_000_003 + index * 10_007 + period * 7_919 + 1) % (2**63 - 1)

    def matrix_step(self, param: torch.Tensor, state: dict, group: dict, step: int,
                    place: Place) -> None:
        """Steps 1-6 for one matrix (AdamW when the rank covers it).

        Arguments as :meth:`rankwise.optim.common.MatrixAdamW.matrix_step`.
        """
        grad = param.grad
        side = projector.choose_side(grad.shape, group["rank"])
        if side == projector.IDENTITY:
            self.defer_adamw(param, state, group, step)
            return
        seed = self.seed_of(group["seed"], place.index, (step - 1) // group["update_every"])
        p = random_basis(min(grad.shape), group["rank"], seed, grad.device, torch.float32)   # (d, r)
        g32 = grad.float()
        low = p.T @ g32 if side == projector.LEFT else g32 @ p     # (r, n) or (m, r)
        beta1, beta2 = group["betas"]
        norm_low = quantized_adam_direction(state, low, beta1, beta2, group["eps"], step,
                                            group["state_bits"])   # R~
        if group["scale_type"] == "channel":
            dim = 0 if side == projector.LEFT else 1                # over the r projected entries
            s = _ratio(norm_low.norm(dim=dim, keepdim=True), low.norm(dim=dim, keepdim=True))  # (1, n) or (m, 1)
        else:
            s = _ratio(norm_low.norm(), low.norm())
        update = g32 * s                                            # G diag(s), (m, n)
        gamma = group["norm_growth"]
        if gamma is not None:   # on G diag(s) without Adam's bias correction c_t (the package's order)
            c_t = math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
            norm = update.norm() / c_t
            prev = state.get("scaled_norm")
            if prev is not None and norm > gamma * prev:
                update.mul_(gamma * prev / norm)
                norm = gamma * prev
            state["scaled_norm"] = norm.detach().clone()
        decay_(param, group["lr"], group["weight_decay"])
        param.add_(update.to(param.dtype), alpha=-group["lr"] * math.sqrt(group["scale"]))


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` with 0 where ``den`` is 0 (a channel with no projected gradient is not moved)."""
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), torch.zeros_like(num))


def apollo_state_floats(model: nn.Module, config: ApolloConfig) -> float:
    """``2 max(m, n) r`` per projected matrix (``2mn`` where the rank covers it), AdamW's 2 per
    element elsewhere; with ``state_bits: 8`` each moment at :func:`rankwise.optim.lowbit.moment_floats`."""
    bits = config.state_bits
    return grouped_state_floats(
        model, config.targets,
        lambda shape: 2 * moment_floats(projector.projected_numel(shape, config.rank), bits), bits)


def build_apollo(model: nn.Module, config: ApolloConfig) -> ApolloAdamW:
    """Registry builder for ``apollo`` and ``apollo-mini``: block matrices get APOLLO, the rest AdamW.

    Args:
        model: The model to train.
        config: The ``optim:`` section.

    Returns:
        The optimizer over the trainable parameters.
    """
    groups = param_groups(model, config.targets, rank=config.rank, update_every=config.update_every,
                          scale=config.scale, scale_type=config.scale_type,
                          norm_growth=config.norm_growth, seed=config.seed)
    return ApolloAdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                       weight_decay=config.weight_decay, state_bits=config.state_bits)
