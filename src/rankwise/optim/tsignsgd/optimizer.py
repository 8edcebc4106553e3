"""t-SignSGD: one grid step of +-1 for the largest gradient entries of ternary tensors."""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from rankwise.core.protocol import adapter_modules
from rankwise.errors import RankwiseError
from rankwise.optim.common import FlaggedGroupsAdamW
from rankwise.optim.tsignsgd.config import TSignSGDConfig


def quantile_at(step: int, total: int, start: float, mid: float, end: float, split: float) -> float:
    """The threshold quantile ``sigma_t`` at 1-based ``step``: linear ``start -> mid`` over the
    first ``split`` of ``total`` steps, then linear ``mid -> end`` (held at ``end`` after)."""
    frac = min(max((step - 1) / total, 0.0), 1.0)
    if frac < split:
        return start + (mid - start) * frac / split
    return mid + (end - mid) * min((frac - split) / max(1.0 - split, 1e-12), 1.0)


def kth_largest_threshold(values: torch.Tensor, q: float) -> torch.Tensor:
    """``quantile(values, q)`` as an order statistic (the ``ceil(q N)``-th smallest value; no
    interpolation, no size limit)."""
    flat = values.flatten()
    k = min(max(math.ceil(q * flat.numel()), 1), flat.numel())
    return flat.kthvalue(k).values


class TSignSGD(FlaggedGroupsAdamW):
    """t-SignSGD (LoTA-QAF, arXiv 2505.18724, Sec. 3.3; the authors' ``tSignSGD.step``).

    For each ternary tensor ``p`` of a group with ``"ternary": True`` and its gradient ``g``::

        sigma_t = the scheduled quantile (quantile_at)
        tau     = quantile(|g|, sigma_t)                         # per tensor
        move    = |g| > tau and |g| > 1e-9
        (second phase, global ||g|| > spike_norm: move &= |g| <= quantile(|g|, spike_quantile))
        p <- clip(round(p - sign(g) * move), -1, 1)

    so only the top ``1 - sigma_t`` of entries move, by exactly one step, and the tensor stays
    in ``{-1, 0, 1}``; there is no learning rate and no state beyond the step count. The global
    norm is over every ternary tensor of the optimizer. Other groups are plain AdamW (a task
    head). Where the authors' code differs from its README the code was followed; the
    schedule's ``total_steps`` must be set to the run's steps (the optimizer cannot see them).

    Args:
        params: Param groups (ternary groups as above).
        lr, betas, eps, weight_decay: The AdamW group's settings.
        total_steps, start_quantile, mid_quantile, end_quantile, phase_split, spike_norm,
            spike_quantile: See :class:`rankwise.optim.tsignsgd.TSignSGDConfig`.
    """

    group_flag = "ternary"
    own_update = ("ternary adapter tensors", "use method.name: lota-qaf, or optim.name: adamw")

    def updates_own_way(self, group: dict, p: torch.Tensor) -> bool:
        """Whether ``p`` is a ternary tensor (the rest steps as AdamW)."""
        return bool(group.get(self.group_flag))

    def keeps_full_rank(self, group: dict, p: torch.Tensor) -> bool:
        """No rank applies to a ternary update."""
        return False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, total_steps: int = 300, start_quantile: float = 0.95,
                 mid_quantile: float = 0.999, end_quantile: float = 0.9999, phase_split: float = 0.8,
                 spike_norm: float = 10.0, spike_quantile: float = 0.99995) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, ternary=False,
                        total_steps=total_steps, start_quantile=start_quantile,
                        mid_quantile=mid_quantile, end_quantile=end_quantile,
                        phase_split=phase_split, spike_norm=spike_norm, spike_quantile=spike_quantile)
        super().__init__(params, defaults)

    def begin_step(self) -> None:
        """The global gradient norm of every ternary tensor (the spike test reads it)."""
        ternary = [p for g in self.param_groups if g["ternary"] for p in g["params"] if p.grad is not None]
        self._norm = (torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ternary]))
                      if ternary else None)

    def param_step(self, p: torch.Tensor, state: dict, group: dict, step: int) -> None:
        """One grid step of the largest gradient entries of ternary ``p`` (see the class docstring)."""
        norm = self._norm
        g = p.grad
        mag = g.abs()
        q = quantile_at(step, group["total_steps"], group["start_quantile"], group["mid_quantile"],
                        group["end_quantile"], group["phase_split"])
        move = (mag > kth_largest_threshold(mag, q)) & (mag > 1e-9)
        second = (step - 1) / group["total_steps"] >= group["phase_split"]
        if second and float(norm) > group["spike_norm"]:
            move &= mag <= kth_largest_threshold(mag, group["spike_quantile"])
        p.sub_(torch.sign(g) * move).round_().clamp_(-1, 1)


def ternary_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of active adapters on layers that declare ``ternary = True``
    (LoTA-QAF's layers), found through the adapter protocol."""
    out: dict[int, nn.Parameter] = {}
    for _, mod in adapter_modules(model):
        if not getattr(mod, "ternary", False):
            continue
        for name in mod.active_names():
            for p in mod.adapter_params(name).values():
                if p.requires_grad:
                    out[id(p)] = p
    return list(out.values())


def build_tsignsgd(model: nn.Module, config: TSignSGDConfig) -> TSignSGD:
    """Registry builder for ``t-signsgd``: ternary adapter tensors get t-SignSGD, every other
    trainable parameter (a task head) AdamW.

    Args:
        model: The model (adapted by ``lota-qaf``).
        config: The ``optim:`` section.

    Returns:
        The optimizer.

    Raises:
        RankwiseError: If ``config.total_steps`` is still ``null`` (a run config fills it
            from ``train.steps``; a direct call must pass it).
    """
    if config.total_steps is None:
        raise RankwiseError("optim.total_steps: got null; expected the number of optimizer steps "
                            "(a run config sets it from train.steps; set it when building directly)")
    ternary = ternary_parameters(model)
    ids = {id(p) for p in ternary}
    rest = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad and id(p) not in ids]
    groups = [g for g in ({"params": rest}, {"params": ternary, "ternary": True}) if g["params"]]
    return TSignSGD(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                    weight_decay=config.weight_decay, total_steps=config.total_steps,
                    start_quantile=config.start_quantile, mid_quantile=config.mid_quantile,
                    end_quantile=config.end_quantile, phase_split=config.phase_split,
                    spike_norm=config.spike_norm, spike_quantile=config.spike_quantile)


def tsignsgd_state_floats(model: nn.Module, config: TSignSGDConfig) -> int:
    """No state for ternary tensors (only the step count); AdamW's 2 per element elsewhere."""
    ids = {id(p) for p in ternary_parameters(model)}
    return 2 * sum(p.numel() for p in dict.fromkeys(model.parameters())
                   if p.requires_grad and id(p) not in ids)
