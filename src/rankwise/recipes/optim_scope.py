"""Which trainable tensors an optimizer updates its own way, and which fall back to AdamW.

GaLore, GaLore-IS, SUMO and Q3R act on the 2-D weight matrices of ``optim.targets`` (by default
the linear layers of the transformer blocks); t-SignSGD acts on ternary adapter tensors
(LoTA-QAF). Everything else they are given steps as plain AdamW. Under an adapter method such
as LoRA the block weights are frozen and the adapter factors are not their targets, so the run
would be AdamW bit for bit: :func:`check` refuses that (as ``lowrank-hb`` and ``altlora``
refuse a model without their layers), and :func:`describe` is the line the run prints and the
numbers ``metrics.json`` records otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch

from rankwise.errors import RankwiseError


@dataclass
class Scope:
    """How far an optimizer's own update reaches.

    Attributes:
        what: What the update acts on, in words.
        fix: How to give it something to act on.
        tensors: Trainable tensors it updates its own way.
        params: Their elements.
        total_tensors: Every trainable tensor the optimizer holds.
        total_params: Their elements.
        unprojected: Of ``tensors``, those whose ``rank`` is at least their smaller side (GaLore
            and Q3R then leave them as AdamW would).
    """

    what: str
    fix: str
    tensors: int = 0
    params: int = 0
    total_tensors: int = 0
    total_params: int = 0
    unprojected: int = 0


def scope(optimizer: torch.optim.Optimizer) -> Scope | None:
    """Count what ``optimizer`` updates its own way (``None``: it has no AdamW fallback).

    The optimizer says it itself: ``own_update`` (what its update acts on, and the fix) and
    ``updates_own_way(group, p)`` / ``keeps_full_rank(group, p)`` (GaLore, SUMO, Q3R and
    GaLore-IS through ``optim.common.MatrixAdamW``, t-SignSGD on its ternary tensors); AdamW,
    NGN and NanoAdam update every tensor their way, and lowrank-* and altlora refuse a model
    without their layers themselves.
    """
    own = getattr(optimizer, "own_update", None)
    if own is None:
        return None
    out = Scope(*own)
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.total_tensors += 1
            out.total_params += p.numel()
            if optimizer.updates_own_way(group, p):
                out.tensors += 1
                out.params += p.numel()
                out.unprojected += optimizer.keeps_full_rank(group, p)
    return out


def check(optimizer: torch.optim.Optimizer, optim_name: str, method_name: str) -> Scope | None:
    """Refuse an optimizer whose own update would apply to nothing; else return its scope.

    Raises:
        RankwiseError: One line naming what the optimizer acts on and the fix.
    """
    s = scope(optimizer)
    if s is not None and s.tensors == 0:
        raise RankwiseError(f"optimizer {optim_name!r} acts on {s.what}, and method {method_name!r} "
                            f"trains none of them: all {s.total_tensors} trainable tensors would step "
                            f"as plain AdamW; {s.fix}")
    return s


def describe(s: Scope, optim_name: str) -> str:
    """One line: how many tensors/parameters the optimizer updates its way, the rest AdamW."""
    line = (f"optimizer {optim_name} updates {s.tensors} of {s.total_tensors} trainable tensors its "
            f"own way ({s.params:,} of {s.total_params:,} parameters), the rest as AdamW")
    if s.unprojected:
        line += (f" ({s.unprojected} of them have optim.rank >= their smaller side: no rank "
                 "reduction there)")
    return line


def metrics(s: Scope | None) -> dict:
    """The ``metrics.json`` fields (none for an optimizer without an AdamW fallback)."""
    if s is None:
        return {}
    return {"optim_own_update_tensors": s.tensors, "optim_own_update_params": s.params,
            "optim_adamw_params": s.total_params - s.params}
