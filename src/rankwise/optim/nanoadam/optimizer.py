"""NanoAdam: Adam restricted to a gradient-free mask of each tensor's smallest weights."""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from rankwise.core.inject import default_heads, head_paths
from rankwise.optim.common import FlaggedGroupsAdamW
from rankwise.optim.nanoadam.config import NanoAdamConfig


def scheduled_density(density: float, final: float | None, step: int, total: int, interval: int) -> float:
    """The density at 1-based ``step``: ``density`` or, with ``final``, a cosine from ``density``
    to ``final`` over ``total`` steps, held constant between multiples of ``interval``.

    Args:
        density: ``k0 / N``.
        final: Density at ``total`` (``None``: constant).
        step: 1-based step.
        total: Schedule length ``T``.
        interval: ``d``: the schedule is read at steps ``1, 1 + d, 1 + 2d, ...``.

    Returns:
        The fraction of entries updated at ``step``.
    """
    if final is None:
        return density
    t = min((step - 1) // interval * interval, total) / total
    return final + (density - final) * 0.5 * (1 + math.cos(math.pi * t))


def smallest_indices(param: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted flat indices of the ``k`` smallest ``|param|`` entries (ties broken by position),
    int32 when they fit, else int64."""
    flat = param.detach().abs().flatten()
    idx = torch.topk(flat, k, largest=False, sorted=False).indices.sort().values
    return idx.to(torch.int32 if flat.numel() < 2**31 else torch.int64)


class NanoAdam(FlaggedGroupsAdamW):
    """NanoAdam (Zhou, Jacobs, Gadhikar, Burkholz; NeurIPS 2025, Algorithm 1).

    For every tensor of a group with ``"masked": True``, at step ``t`` (1-based):

    * every ``d`` steps the density ``k_t / N`` is read from the schedule
      (:func:`scheduled_density`); every ``m`` steps, or when the density changed, the index set
      ``I = Bottom_k(|theta_t|)`` of the tensor's ``k = max(1, round(density N))``
      smallest-magnitude entries is recomputed - from the weights only, no gradient (line 9);
    * Adam updates ``theta[I]`` with moments ``m, v`` of length ``k`` kept for ``I`` only
      (``torch.optim.AdamW``'s arithmetic on the gathered gradient ``g[I]``); decoupled weight
      decay touches ``theta[I]`` only. Every entry outside ``I`` is left bit for bit as it was.

    Choices where the paper's text was not available to us (its Algorithm 1 is truncated in
    what we could read): ``k`` is per tensor ("per-layer bottom-k", as a summary of the paper
    puts it); when ``I`` is recomputed, an entry that stays selected keeps its moments and its
    own bias-correction count, an entry that enters starts at zero moments and count 0 (Adam
    starts afresh on that entry only), and the moments of an entry that leaves are dropped -
    so a recomputation that selects the same set changes nothing, and density 1 is
    ``torch.optim.AdamW`` exactly whatever ``mask_interval`` is (tested); the schedule is a
    cosine between ``density`` and ``final_density``. Tensors of other groups (1-D parameters,
    output heads: the builder's choice) get plain AdamW.

    State per masked tensor: ``index`` (``k`` int32), ``exp_avg`` and ``exp_avg_sq`` (``k``
    floats each) and ``entry_step`` (``k`` int32, each entry's Adam step count since it was
    last selected): ``4k`` 4-byte words (int64 indices past ``2^31`` entries: ``5k``).

    Args:
        params: Param groups; ``masked`` groups carry ``density``, ``final_density``,
            ``mask_interval``, ``density_interval``, ``total_steps``.
        lr: Learning rate.
        betas: Adam's betas.
        eps: Adam's epsilon.
        weight_decay: Decoupled weight decay.
    """

    group_flag = "masked"

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, masked=False,
                        density=0.1, final_density=None, mask_interval=100, density_interval=100,
                        total_steps=1000)
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, keeping the integer state integer.

        torch casts every non-``step`` state tensor to the parameter's float dtype; the indices
        and per-entry step counts are put back as saved (a float32 index is inexact past 2^24).

        Args:
            state_dict: As returned by :meth:`state_dict`.
        """
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for key in ("index", "entry_step"):
                if key in saved.get(i, {}):
                    self.state[p][key] = saved[i][key].to(device=p.device)

    def param_step(self, p: torch.Tensor, state: dict, group: dict, step: int) -> None:
        """Adam on the bottom-k entries of ``p`` (see the class docstring)."""
        density = scheduled_density(group["density"], group["final_density"], step,
                                    group["total_steps"], group["density_interval"])
        k = max(1, round(density * p.numel()))
        if "index" not in state or (step - 1) % group["mask_interval"] == 0 or state["index"].numel() != k:
            reselect(state, smallest_indices(p, k), p)
        idx = state["index"].long()
        flat = p.view(-1)                                    # (N,), shares p's storage
        grad = p.grad.reshape(-1).index_select(0, idx)       # (k,)
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["entry_step"] += 1
        t = state["entry_step"].to(torch.float64)            # (k,) per-entry bias correction
        bc1 = (1 - beta1 ** t).to(p.dtype)
        bc2_sqrt = (1 - beta2 ** t).sqrt().to(p.dtype)
        direction = (m / bc1).div_((v.sqrt() / bc2_sqrt).add_(group["eps"]))
        values = flat.index_select(0, idx)
        if group["weight_decay"]:
            values.mul_(1 - group["lr"] * group["weight_decay"])
        flat.index_copy_(0, idx, values.add_(direction, alpha=-group["lr"]))


def reselect(state: dict, new: torch.Tensor, p: torch.Tensor) -> None:
    """Switch ``state`` to the sorted index set ``new``: entries already selected keep their
    moments and step counts, entering entries start at zero, leaving entries are dropped.

    Args:
        state: The tensor's optimizer state (``index``, ``exp_avg``, ``exp_avg_sq``,
            ``entry_step``; created if absent).
        new: Sorted flat indices of the new selection, ``(k,)``.
        p: The parameter (dtype and device of the moments).
    """
    k = new.numel()
    m = torch.zeros(k, dtype=p.dtype, device=p.device)
    v = torch.zeros(k, dtype=p.dtype, device=p.device)
    t = torch.zeros(k, dtype=torch.int32, device=p.device)
    old = state.get("index")
    if old is not None and old.numel():
        if "entry_step" not in state:                     # a checkpoint of the one-count layout
            count = int(state.pop("mask_step", torch.tensor(0.0)).item())
            state["entry_step"] = torch.full((old.numel(),), count, dtype=torch.int32, device=p.device)
        old_l, new_l = old.long(), new.long()
        pos = torch.searchsorted(old_l, new_l).clamp_max(old_l.numel() - 1)   # (k,)
        kept = old_l[pos] == new_l                                             # stays selected
        m[kept] = state["exp_avg"][pos[kept]]
        v[kept] = state["exp_avg_sq"][pos[kept]]
        t[kept] = state["entry_step"][pos[kept]]
    state.update(index=new, exp_avg=m, exp_avg_sq=v, entry_step=t)
    state.pop("mask_step", None)


def nanoadam_param_groups(model: nn.Module, config: NanoAdamConfig) -> list[dict]:
    """``[plain AdamW group, masked group]``: every trainable tensor with 2 or more dimensions
    outside an output head is masked; 1-D tensors (norms, biases) and heads (the task head a
    fine-tune adds, ``lm_head``) are updated in full.

    Args:
        model: The model; only trainable parameters are used.
        config: Supplies the mask settings.

    Returns:
        Non-empty param-group dicts for :class:`NanoAdam`.
    """
    heads = head_paths(model) | set(default_heads(model))
    head_params = {id(p) for path in heads for p in model.get_submodule(path).parameters()}
    masked, plain, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (masked if p.ndim >= 2 and id(p) not in head_params else plain).append(p)
    groups = [{"params": plain},
              {"params": masked, "masked": True, "density": config.density,
               "final_density": config.final_density, "mask_interval": config.mask_interval,
               "density_interval": config.density_interval, "total_steps": config.total_steps}]
    return [g for g in groups if g["params"]]


def build_nanoadam(model: nn.Module, config: NanoAdamConfig) -> NanoAdam:
    """Registry builder for ``nanoadam``.

    Args:
        model: The model to train.
        config: The ``optim:`` section.

    Returns:
        The optimizer over the trainable parameters.
    """
    return NanoAdam(nanoadam_param_groups(model, config), lr=config.lr, betas=config.betas,
                    eps=config.eps, weight_decay=config.weight_decay)


def nanoadam_state_floats(model: nn.Module, config: NanoAdamConfig) -> int:
    """NanoAdam's state at the initial density: ``k (3 + w)`` per masked tensor with
    ``k = max(1, round(density N))`` (two moments and an int32 step count per entry) and ``w``
    4-byte words per index (1 for int32), AdamW's 2 per element for the rest.

    Args:
        model: The model.
        config: Supplies ``density``.

    Returns:
        State floats (4-byte words).
    """
    total = 0
    for group in nanoadam_param_groups(model, config):
        for p in group["params"]:
            if group.get("masked"):
                k = max(1, round(config.density * p.numel()))
                total += k * (3 + (1 if p.numel() < 2**31 else 2))
            else:
                total += 2 * p.numel()
    return total
