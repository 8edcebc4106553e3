"""The ``simpo`` task: SimPO (and CPO's losses) on ``{prompt, chosen, rejected}`` pairs.

Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", eq. 6:
with ``|y|`` the completion's tokens and ``log pi(y|x)`` their summed log-probability,

    L_SimPO = -log sigma(beta / |y_w| * log pi(y_w|x) - beta / |y_l| * log pi(y_l|x) - gamma)

As TRL 1.16's ``trl.experimental.cpo.CPOTrainer`` with ``loss_type="simpo"`` (the parity
reference), the loss is ``mean_pairs(L) + cpo_alpha * NLL(y_w)``, the NLL the mean over every
chosen completion token of the micro-batch (the behaviour-cloning regulariser of CPO, Xu et al.
2024, "Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance in Machine
Translation"). **TRL's defaults, not the paper's:**
``cpo_alpha = 1`` (the SimPO paper has no NLL term: set ``task.cpo_alpha: 0`` for its loss, TRL's
"CPO-SimPO" otherwise), ``beta = 0.1`` and ``gamma = 0.5`` (the paper tunes ``beta`` in 2-10 and
``gamma / beta`` in 0.3-1.6). ``task.label_smoothing`` ``eps`` gives TRL's conservative form,
``-(1 - eps) log sigma(z) - eps log sigma(-z)``.

The other losses of ``CPOTrainer`` come with it (``task.loss``), on ``h`` the difference of the
chosen and rejected log-probs, summed (``sigmoid``, ``hinge``) or per token (``simpo``, ``ipo``):

* ``sigmoid``: CPO (Xu et al. 2024, eq. 3), ``-log sigma(beta h)``;
* ``hinge``: SLiC (Zhao et al. 2023), ``max(0, 1 - beta h)``;
* ``ipo``: IPO (Azar et al. 2023, eq. 17) without a reference, ``(h - 1 / (2 beta))^2``.

Rewards (logged) are ``beta`` times each completion's log-prob as the loss reads it. Every dropout
is switched off before training (``disable_dropout``, TRL's default). There is no reference
model: one forward per batch (:class:`~rankwise.tasks.reference_free.ReferenceFreeTask`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.nn import functional as F

from rankwise.configs import bounded
from rankwise.engine.task import TaskConfig
from rankwise.tasks.pair_task import pair_run_problems
from rankwise.tasks.reference_free import ReferenceFreeTask

LOSSES = ("simpo", "sigmoid", "hinge", "ipo")
AVERAGED = ("simpo", "ipo")  # the losses on the mean log-prob per completion token


@dataclass
class SimPOConfig(TaskConfig):
    """The ``task:`` section of ``task: {name: simpo}``.

    Attributes:
        name: ``simpo``.
        loss: ``simpo`` (SimPO), ``sigmoid`` (CPO), ``hinge`` or ``ipo`` (see
            :mod:`rankwise.tasks.simpo.task`).
        beta: ``beta`` (> 0; TRL's ``CPOConfig`` default).
        gamma: SimPO's target reward margin ``gamma`` (>= 0; TRL's ``simpo_gamma``; ``simpo`` only).
        cpo_alpha: Weight of the chosen completions' NLL (>= 0; TRL's default 1; 0 is the SimPO
            paper's loss).
        label_smoothing: ``eps`` in [0, 0.5) of the conservative form (``simpo`` and ``sigmoid``).
        disable_dropout: Set every dropout of the model to ``p = 0`` before training (TRL's
            ``CPOConfig`` default; :func:`rankwise.tasks.reference.disable_dropout`).
    """

    name: str = "simpo"
    loss: Literal["simpo", "sigmoid", "hinge", "ipo"] = "simpo"
    beta: float = bounded(0.1, gt=0)
    gamma: float = bounded(0.5, ge=0, what="a margin", hint="(SimPO's target reward margin)")
    cpo_alpha: float = bounded(1.0, ge=0, what="a weight", hint="(0: no NLL term)")
    label_smoothing: float = bounded(0.0, ge=0, lt=0.5)
    disable_dropout: bool = True

    def problems(self) -> list[str]:
        """Return value errors (the ranges are declared on the fields)."""
        if 0 < self.label_smoothing < 0.5 and self.loss not in ("simpo", "sigmoid"):
            return [f"label_smoothing: applies to loss simpo or sigmoid only (got loss {self.loss}); "
                    "set it to 0"]
        return []

    def run_problems(self, run: Any) -> list[str]:
        """Pairs are scored whole: packing, samples, ``data.train_on_prompt`` and a length
        schedule are refused."""
        return pair_run_problems(self.name, run)


def simpo_losses(logps: torch.Tensor, loss: str, beta: float, gamma: float = 0.0,
                 label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair losses and rewards of ``CPOTrainer``'s loss types.

    Args:
        logps: ``(B, 2)`` chosen, rejected log-probs (mean per token for ``simpo`` / ``ipo``,
            sums for ``sigmoid`` / ``hinge``).
        loss: One of :data:`LOSSES`.
        beta: ``beta``.
        gamma: SimPO's margin (``simpo``).
        label_smoothing: ``eps`` (``simpo``, ``sigmoid``).

    Returns:
        ``(losses (B,), rewards = beta * logps (B, 2))``.
    """
    logps = logps.float()
    h = logps[:, 0] - logps[:, 1]
    if loss in ("simpo", "sigmoid"):
        z = beta * h - (gamma if loss == "simpo" else 0.0)
        out = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    elif loss == "hinge":
        out = torch.relu(1 - beta * h)
    elif loss == "ipo":
        out = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"simpo.loss: got {loss!r}; expected one of {LOSSES}")
    return out, beta * logps.detach()


class SimPOTask(ReferenceFreeTask):
    """Preference pairs ``{prompt, chosen, rejected}`` trained with SimPO or a CPO loss: one
    target per pair.

    Args:
        config: The ``task:`` section (default: :class:`SimPOConfig`).
    """

    name = "simpo"

    def __init__(self, config: SimPOConfig | None = None) -> None:
        super().__init__(config or SimPOConfig())

    def average(self) -> bool:
        """``simpo`` and ``ipo`` read the mean log-prob per completion token."""
        return self.config.loss in AVERAGED

    def nll_weight(self) -> float:
        """``task.cpo_alpha``."""
        return self.config.cpo_alpha

    def pair_losses(self, logps):
        """:func:`simpo_losses` with the section's settings."""
        c = self.config
        losses, rewards = simpo_losses(logps, c.loss, c.beta, c.gamma, c.label_smoothing)
        return losses, rewards, {}


__all__ = ["LOSSES", "SimPOConfig", "SimPOTask", "simpo_losses"]
