"""The ``orpo`` task: Odds Ratio Preference Optimization on ``{prompt, chosen, rejected}`` pairs.

Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model", eq. 6-7.
With ``P(y|x) = exp(mean per completion token of log pi(y_t | x, y_<t))`` (the length-normalised
likelihood of the paper's section 3) and ``odds(y|x) = P / (1 - P)``, per pair

    L_OR  = -log sigma(log odds(y_w|x) - log odds(y_l|x))                       (eq. 7)
    L     = NLL(y_w) + lambda * L_OR                                            (eq. 6)

``log odds = log P - log(1 - P)``, the second term by :func:`~rankwise.tasks.reference_free.log1mexp`.
``lambda`` is ``task.beta`` (TRL's ``ORPOConfig.beta``; the authors' code calls it ``alpha``).

As TRL 1.16's ``trl.experimental.orpo.ORPOTrainer`` (the parity reference):

* the NLL is the mean over every target token of the micro-batch's chosen rows (not per pair
  first), and it covers the **prompt** as well as the completion (every non-padding token;
  ``task.sft_on_prompt: false`` restricts it to the completion, which is how eq. 6's
  ``L_SFT`` reads; the authors' released trainer has the same switch, ``disable_prompt_loss``);
* the logged rewards are ``beta * mean log-prob per token`` of each completion;
* every dropout is switched off before training (``disable_dropout``, TRL's default).

There is no reference model: one forward per batch
(:class:`~rankwise.tasks.reference_free.ReferenceFreeTask`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from rankwise.engine.task import TaskConfig
from rankwise.tasks.pair_task import pair_run_problems
from rankwise.tasks.reference_free import ReferenceFreeTask, log1mexp


@dataclass
class ORPOConfig(TaskConfig):
    """The ``task:`` section of ``task: {name: orpo}``.

    Attributes:
        name: ``orpo``.
        beta: ``lambda``, the weight of the odds-ratio term (TRL's ``beta``; > 0).
        sft_on_prompt: The NLL covers the prompt's tokens too (TRL's behaviour); ``false``: the
            chosen completion's tokens only.
        disable_dropout: Set every dropout of the model to ``p = 0`` before training (TRL's
            ``ORPOConfig`` default; :func:`rankwise.tasks.reference.disable_dropout`).
    """

    name: str = "orpo"
    beta: float = 0.1
    sft_on_prompt: bool = True
    disable_dropout: bool = True

    def problems(self) -> list[str]:
        """Return value errors."""
        return [] if self.beta > 0 else [f"beta: got {self.beta}; expected a value > 0 (ORPO's lambda)"]

    def run_problems(self, run: Any) -> list[str]:
        """Pairs are scored whole: packing, samples, ``data.train_on_prompt`` and a length
        schedule are refused."""
        return pair_run_problems(self.name, run,
                                 prompt_fix=" (task.sft_on_prompt sets the prompt's share of the NLL)")


def orpo_losses(logps: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO's odds-ratio term per pair.

    Args:
        logps: ``(B, 2)`` mean log-prob per completion token (chosen, rejected), each ``< 0``.
        beta: ``lambda``.

    Returns:
        ``(lambda * L_OR (B,), rewards = beta * logps (B, 2), {"log_odds_ratio": log sigma(h),
        "log_odds_chosen": h})`` with ``h`` the log odds ratio (TRL's logged names).
    """
    logps = logps.float()
    log_odds = (logps[:, 0] - logps[:, 1]) - (log1mexp(logps[:, 0]) - log1mexp(logps[:, 1]))
    ratio = F.logsigmoid(log_odds)
    return -beta * ratio, beta * logps.detach(), {"log_odds_ratio": ratio, "log_odds_chosen": log_odds}


class ORPOTask(ReferenceFreeTask):
    """Preference pairs ``{prompt, chosen, rejected}`` trained with ORPO: one target per pair.

    Args:
        config: The ``task:`` section (default: :class:`ORPOConfig`).
    """

    name = "orpo"

    def __init__(self, config: ORPOConfig | None = None) -> None:
        super().__init__(config or ORPOConfig())

    def average(self) -> bool:
        """The odds are of the length-normalised likelihood."""
        return True

    def nll_weight(self) -> float:
        """ORPO's NLL has weight 1 (``lambda`` weighs the odds-ratio term)."""
        return 1.0

    def nll_on_prompt(self) -> bool:
        """``task.sft_on_prompt`` (TRL: the prompt too)."""
        return self.config.sft_on_prompt

    def pair_losses(self, logps):
        """:func:`orpo_losses` with ``task.beta``."""
        return orpo_losses(logps, self.config.beta)


__all__ = ["ORPOConfig", "ORPOTask", "orpo_losses"]
