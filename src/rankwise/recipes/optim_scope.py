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
from typing import Callable

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


def _rules(optimizer: torch.optim.Optimizer) -> tuple[str, str, Callable[[dict, torch.Tensor], bool]] | None:
    """(what, fix, picks(group, param)) for optimizers with an AdamW fallback; ``None`` for the
    rest (AdamW, NGN and NanoAdam update every tensor their way; lowrank-* and altlora refuse
    a model without their layers themselves)."""
    from rankwise.optim.common import MatrixAdamW
    from rankwise.optim.tsignsgd.optimizer import TSignSGD
    if isinstance(optimizer, MatrixAdamW):
        return ("trainable 2-D weight matrices of optim.targets (default: the linear layers of "
                "the transformer blocks)", "train them (method.name: full) or use optim.name: adamw",
                lambda g, p: g.get("rank") is not None and p.ndim == 2)
    if isinstance(optimizer, TSignSGD):
        return ("ternary adapter tensors", "use method.name: lota-qaf, or optim.name: adamw",
                lambda g, p: bool(g.get("ternary")))
    return None


def scope(optimizer: torch.optim.Optimizer) -> Scope | None:
    """Count what ``optimizer`` updates its own way (``None``: it has no AdamW fallback)."""
    rules = _rules(optimizer)
    if rules is None:
        return None
    what, fix, picks = rules
    out = Scope(what, fix)
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.total_tensors += 1
            out.total_params += p.numel()
            if picks(group, p):
                out.tensors += 1
                out.params += p.numel()
                out.unprojected += _full_rank(optimizer, group, p)
    return out


def _full_rank(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> bool:
    """Whether the group's rank covers the smaller side of ``p`` (Q3R: its per-matrix rank)."""
    from rankwise.optim.q3r.optimizer import Q3RAdamW, target_rank
    rank = group.get("rank")
    if rank is None or p.ndim != 2:
        return False
    if isinstance(optimizer, Q3RAdamW):
        rank = target_rank(rank, tuple(p.shape), group["scale_rank"])
    return rank >= min(p.shape)


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
