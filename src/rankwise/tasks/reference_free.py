"""What the reference-free preference tasks (``orpo``, ``simpo``) share: DPO's pairs without
DPO's reference.

The records, the batch layout (rows ``0..B-1`` the chosen completions, ``B..2B-1`` the rejected
ones), the target count (one per pair) and evaluation in slices of whole pairs are the pair
tasks' (:class:`~rankwise.tasks.pair_task.PairTask`, as DPO's); what differs is the loss, which needs **one**
forward per batch (no reference model, no adapters-off pass):

    loss = mean_pairs(preference term) + w * NLL(chosen)

The preference term is the task's (:meth:`ReferenceFreeTask.pair_losses`), on each completion's
log-probability summed over its tokens or divided by their number. ``NLL(chosen)`` is the
negative log-likelihood of the chosen rows' target tokens, averaged over **all** of them in the
micro-batch, as TRL's ``nn.CrossEntropyLoss()`` does in ``ORPOTrainer`` and ``CPOTrainer``
(so a long chosen completion weighs more than a short one): per micro-batch the loss is TRL's.
As a sum over pairs (what the engine normalises by the step's pairs) that is
``sum(preference) + w * B * NLL``; under gradient accumulation a step is then the pair-weighted
mean of its micro-batches' losses, as TRL's is (the mean, for equal micro-batches).
Evaluation sums the NLL's tokens and the preference term's pairs over the whole evaluation set,
so its ``eval_loss`` does not depend on the evaluation batch size.

Every log-probability comes from one pass, :meth:`ReferenceFreeTask.pair_logps`, through
:func:`rankwise.tasks.logprobs.target_logps`: with ``train.loss_chunk_tokens`` the target
positions (the completions', and ORPO's chosen prompt tokens for its NLL) are projected in
checkpointed chunks and the ``(2B, T, V)`` logits are never formed; both terms read the same
per-token log-probs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rankwise.engine.task import IGNORE
from rankwise.tasks.logprobs import TargetLogps, target_logps
from rankwise.tasks.pair_task import PAIR_METRICS, PairTask, add_pair_stats, pair_means
from rankwise.tasks.pairs import by_pair
from rankwise.tasks.reference import disable_dropout

LOG_HALF = -math.log(2.0)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation (Maechler 2012: ``log1p(-exp(x))``
    below ``-log 2``, ``log(-expm1(x))`` above)."""
    return torch.where(x < LOG_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@dataclass
class PairOutput:
    """What one forward of a reference-free pair task measured (detached).

    Attributes:
        logps: ``(B, 2)`` chosen, rejected log-probs as the preference term reads them (mean
            per token or sum).
        rewards: ``(B, 2)`` ``beta * logps``: TRL's logged rewards.
        losses: ``(B,)`` the preference term per pair.
        nll_sum: The chosen rows' summed negative log-likelihood (0 when its weight is 0).
        nll_tokens: Its target tokens.
        extras: Per-pair ``(B,)`` values the task logs besides (ORPO's log-odds).
    """

    logps: torch.Tensor
    rewards: torch.Tensor
    losses: torch.Tensor
    nll_sum: float
    nll_tokens: float
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


class ReferenceFreeTask(PairTask):
    """Base of ``orpo`` and ``simpo``: a preference term on the policy's own completion
    log-probs plus ``w`` times the chosen rows' NLL, from one forward (module docstring).

    Subclasses set ``name``, implement :meth:`pair_losses`, and say through :meth:`average`,
    :meth:`nll_weight` and :meth:`nll_on_prompt` how the log-probs are read and what the NLL
    covers.
    """

    def average(self) -> bool:
        """Whether the preference term reads each completion's mean log-prob per token (else its sum)."""
        raise NotImplementedError

    def nll_weight(self) -> float:
        """``w``, the weight of the chosen rows' NLL (0: not computed)."""
        raise NotImplementedError

    def nll_on_prompt(self) -> bool:
        """Whether the NLL also covers the prompt's tokens (ORPO in TRL) or the completion only."""
        return False

    def pair_losses(self, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The preference term.

        Args:
            logps: ``(B, 2)`` chosen, rejected log-probs (mean per token when :meth:`average`).

        Returns:
            ``(losses (B,), rewards (B, 2), extras {name: (B,)})``.
        """
        raise NotImplementedError

    def pair_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]
                   ) -> tuple[TargetLogps, TargetLogps | None]:
        """The log-probs of one forward of the batch's ``2B`` rows: every log-prob of the task
        comes from here, in chunks of ``loss_chunk_tokens`` target positions when set.

        Args:
            model: The policy.
            batch: The collated pairs.

        Returns:
            ``(completion targets (labels != -100), the chosen rows' prompt targets)``; the
            second is ``None`` unless the NLL is weighted and covers the prompt
            (:meth:`nll_on_prompt`), when the one forward scores both sets of positions.
        """
        inputs = {k: v for k, v in batch.items() if k != "ref_logps"}
        prompt = bool(self.nll_weight()) and self.nll_on_prompt()
        seen: dict[str, torch.Tensor] = {}

        def forward() -> tuple[Any, dict]:
            out, fwd = self._forward(model, inputs)
            labels = seen["labels"] = fwd["labels"]                  # (2B, T'): input adapters' positions in front
            if prompt:                                               # disjoint from the completion targets
                labels = torch.where(labels != IGNORE, labels, _prompt_labels(batch, labels.shape[1]))
            return out, {**fwd, "labels": labels}

        got = target_logps(model, forward, self.loss_chunk_tokens)
        if not prompt:
            return got, None
        completion = seen["labels"][:, 1:] != IGNORE                 # (2B, T'-1)
        return got.where(completion), got.where(~completion)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, PairOutput]:
        """``sum(preference term) + w * B * NLL`` of one forward of the ``2B`` rows."""
        pairs = self.count_targets(batch)
        completion, prompt = self.pair_logps(model, batch)
        sums, counts = by_pair(completion.sums()), by_pair(completion.counts())  # (B, 2) each
        logps = sums / counts.clamp(min=1.0) if self.average() else sums
        losses, rewards, extras = self.pair_losses(logps)
        total = losses.sum()
        nll_sum, nll_tokens = sums.new_zeros(()), counts[:, 0].sum()
        if self.nll_weight():
            nll_sum = -sums[:, 0].sum()
            if prompt is not None:
                nll_sum, nll_tokens = nll_sum - prompt.sums().sum(), nll_tokens + prompt.counts().sum()
            total = total + self.nll_weight() * pairs * nll_sum / nll_tokens.clamp(min=1.0)
        output = PairOutput(logps.detach(), rewards.detach(), losses.detach(), float(nll_sum.detach()),
                            float(nll_tokens) if self.nll_weight() else 0.0,
                            {k: v.detach() for k, v in extras.items()})
        if model.training:
            _add(self._sums, output)
        return total, output

    def prepare(self, model: nn.Module, datasets: list, trains_full: bool, batch_size: int,
                device: str) -> None:
        """Switch dropout off (``task.disable_dropout``, TRL's default); there is no reference."""
        if self.config.disable_dropout:
            disable_dropout(model)
        return None

    def step_metrics(self) -> dict[str, float]:
        """Means over the pairs (the NLL over its tokens) of the training forwards since the last
        call (this process's)."""
        sums, self._sums = self._sums, {}
        return _means(sums, "")

    def eval_update(self, stats, batch, output, loss_sum):
        """The pairs, the preference term's and the NLL's sums, the rewards and log-probs."""
        _add(stats, output)

    def eval_metrics(self, stats):
        """``eval_loss = mean preference term + w * NLL`` over the whole evaluation set (the NLL
        over all its chosen target tokens), ``eval_nll_loss``, ``eval_reward_accuracy`` (share
        of pairs whose chosen reward is higher), ``eval_reward_margin``, the mean rewards and
        log-probs, and the task's own (ORPO's ``eval_log_odds_ratio``, ``eval_log_odds_chosen``)."""
        n = max(stats.get("pairs", 0.0), 1.0)
        nll = stats.get("nll_sum", 0.0) / max(stats.get("nll_tokens", 0.0), 1.0)
        return {"eval_loss": stats.get("pref", 0.0) / n + self.nll_weight() * nll, **_means(stats, "eval_")}


def _prompt_labels(batch: dict[str, torch.Tensor], width: int) -> torch.Tensor:
    """``(2B, width)`` targets of the chosen rows' prompt tokens (every non-padding position after
    the first that the completion labels leave out), ``-100`` on the rejected rows; left-padded
    with ``-100`` to the forward's width (input adapters put their positions in front, and the
    first real token stays no target behind them)."""
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    prompt = torch.where((mask == 1) & (labels == IGNORE), ids, torch.full_like(ids, IGNORE))
    prompt[ids.shape[0] // 2:] = IGNORE                             # the rejected rows
    prompt[:, 0] = IGNORE                                           # nothing predicts the first token
    front = width - prompt.shape[1]
    return torch.nn.functional.pad(prompt, (front, 0), value=IGNORE) if front else prompt


def _add(stats: dict[str, float], output: PairOutput) -> None:
    add_pair_stats(stats, output.rewards, output.logps)
    values = [("pref", output.losses.float().sum()), ("nll_sum", output.nll_sum),
              ("nll_tokens", output.nll_tokens)]
    values += [(name, v.float().sum()) for name, v in output.extras.items()]
    for key, value in values:
        stats[key] = stats.get(key, 0.0) + float(value)


FIXED = set(PAIR_METRICS) | {"pairs", "pref", "nll_sum", "nll_tokens"}


def _means(stats: dict[str, float], prefix: str) -> dict[str, float]:
    out = pair_means(stats, prefix)
    if not out:
        return {}
    n = stats["pairs"]
    out.update({prefix + key: v / n for key, v in stats.items() if key not in FIXED})
    if stats.get("nll_tokens"):
        out[prefix + "nll_loss"] = stats["nll_sum"] / stats["nll_tokens"]
    return out


__all__ = ["PairOutput", "ReferenceFreeTask", "log1mexp"]
