"""The ``dpo`` task: Direct Preference Optimization on ``{prompt, chosen, rejected}`` pairs.

Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model", eq. 7. With the sequence log-probability ``log pi(y|x)`` summed over the
*completion* tokens only (the prompt carries no term; the convention of TRL), the implicit
reward of a completion is ``r(y) = beta * (log pi(y|x) - log pi_ref(y|x))``. The per-pair loss
is ``task.loss``: DPO's ``sigmoid`` (with conservative label smoothing), ``ipo``, ``hinge`` and
the rest of TRL 1.16's loss types, or a weighted list of them (``task.loss_weights``); their
formulas and papers are in :mod:`rankwise.tasks.dpo.losses`.

The reference ``pi_ref`` is the same network with its adapters switched off
(:func:`rankwise.core.ops.disable_adapters`, no second copy), or, for full fine-tuning,
log-probabilities computed once before training with the initial weights and kept with the
dataset (:meth:`DPOTask.prepare`), or, for a run that starts from an existing adapter
(``model.adapter``), that starting model through a frozen copy of its trainable tensors
(``initial``, :mod:`rankwise.tasks.reference`; TRL's ``ref`` adapter). A batch holds the chosen
rows, then the rejected rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal, Union

import torch
from torch import nn

from rankwise.configs import bounded
from rankwise.engine.task import TaskConfig
from rankwise.errors import closest
from rankwise.tasks.dpo.losses import LOSSES, SMOOTHED, dpo_losses
from rankwise.tasks.logprobs import logits_logps
from rankwise.tasks.pair_task import PairTask, add_pair_stats, pair_means, pair_run_problems
from rankwise.tasks.reference import WeightSnapshot, precompute_logps, prepare_reference, reference, reference_problems


@dataclass
class DPOConfig(TaskConfig):
    """The ``task:`` section of ``task: {name: dpo}``.

    Attributes:
        name: ``dpo``.
        loss: A loss of :data:`rankwise.tasks.dpo.losses.LOSSES` (``sigmoid``: DPO; ``ipo``,
            ``hinge``, ``robust``, ``exo_pair``, ``nca_pair``, ``bco_pair``, ``sppo_hard``,
            ``aot``, ``aot_unpaired``, ``apo_zero``, ``apo_down``, ``discopop``,
            ``sigmoid_norm``, ``sft``; formulas and papers in :mod:`rankwise.tasks.dpo.losses`),
            or a list of them, summed with ``loss_weights`` (TRL's ``loss_type`` list).
        loss_weights: One weight per entry of ``loss`` (TRL's ``loss_weights``); ``null``: 1
            each.
        beta: The KL strength ``beta`` (IPO's ``tau``).
        label_smoothing: ``eps`` in [0, 0.5): the share of pairs assumed mislabelled, read by
            ``sigmoid`` (conservative DPO), ``robust`` (the flip rate), ``exo_pair`` (its label
            smoothing, > 0 required), ``aot`` and ``aot_unpaired``.
        discopop_tau: DiscoPOP's temperature ``tau`` (``discopop`` only).
        reference: Where ``pi_ref`` comes from: ``adapters-off`` (the model with its adapters
            disabled, at every step: the base), ``precomputed`` (log-probs of the initial
            weights, computed once before training), ``initial`` (the model as the run starts,
            from a frozen copy of its trainable tensors, at every step; with ``model.adapter``
            or a full fine-tune), ``auto`` (``initial`` with ``model.adapter``, ``precomputed``
            for methods that train every weight, else ``adapters-off``).
        disable_dropout: Set every dropout of the model (base and adapters) to ``p = 0`` before
            training (:func:`rankwise.tasks.reference.disable_dropout`; TRL's ``DPOConfig``
            default), so the policy and reference forwards see the same network and a fresh
            adapter's first loss is ``log 2``. ``false``: dropout stays on in the training
            forwards of both (the behaviour before this switch).
    """

    name: str = "dpo"
    loss: Union[str, list[str]] = "sigmoid"
    loss_weights: Union[list[float], None] = None
    beta: float = bounded(0.1, gt=0)
    label_smoothing: float = bounded(0.0, ge=0, lt=0.5)
    discopop_tau: float = bounded(0.05, gt=0, lt=math.inf)
    reference: Literal["auto", "adapters-off", "precomputed", "initial"] = "auto"
    disable_dropout: bool = True

    def losses(self) -> list[str]:
        """``loss`` as a list of names."""
        return [self.loss] if isinstance(self.loss, str) else list(self.loss)

    def problems(self) -> list[str]:
        """Return value errors: unknown or repeated losses, weights that do not match them, and
        ``label_smoothing`` / ``discopop_tau`` set for losses that do not read them."""
        names = self.losses()
        out = [] if names else ["loss: got []; expected a loss or a list of losses, e.g. [sigmoid, sft]"]
        for n in names:
            if n == "aot_pair":
                out.append("loss: aot_pair is TRL 0.x's name of TRL 1.16's aot_unpaired (aot is the "
                           "paired loss); write aot_unpaired")
            elif n not in LOSSES:
                out.append(f"loss: got {n!r}; expected one of {list(LOSSES)}{closest(n, LOSSES)}")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            out.append(f"loss: {', '.join(repeated)} listed more than once; list each loss once and "
                       "weigh it with loss_weights")
        weights = self.loss_weights
        if weights is not None and len(weights) != len(names):
            out.append(f"loss_weights: got {len(weights)} weights for {len(names)} losses {names}; "
                       "give one weight per loss, in the same order")
        if weights is not None and not all(math.isfinite(w) and w >= 0 for w in weights):
            out.append(f"loss_weights: got {weights}; expected finite values >= 0")
        if self.label_smoothing and not any(n in SMOOTHED for n in names):
            out.append(f"label_smoothing: read by loss {', '.join(SMOOTHED)} only (got loss "
                       f"{self.loss}); set it to 0")
        if "exo_pair" in names and not self.label_smoothing > 0:
            out.append("label_smoothing: loss exo_pair needs a value > 0 (log eps is in it; the EXO "
                       "paper uses 0.001); set task.label_smoothing: 0.001")
        tau = self.discopop_tau  # its range is declared on the field
        if 0 < tau < math.inf and tau != _default(type(self), "discopop_tau") and "discopop" not in names:
            out.append(f"discopop_tau: read by loss discopop only (got loss {self.loss}); remove it")
        return out

    def run_problems(self, run: Any) -> list[str]:
        """The reference must exist (``initial`` needs a start); pairs are scored whole, on their
        completions, so packing, samples, prompt targets and a length schedule are refused."""
        return reference_problems(self.reference, run) + pair_run_problems(self.name, run)


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in fields(cls) if f.name == name)


def completion_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row sum of the log-probabilities of the target tokens (labels ``!= -100``), from
    formed logits (:func:`rankwise.tasks.logprobs.logits_logps`; the task itself goes through
    :func:`rankwise.tasks.logprobs.target_logps`, in chunks).

    Args:
        logits: ``(R, T, V)`` model output.
        labels: ``(R, T)`` token ids, ``-100`` on prompt and padding.

    Returns:
        ``(log-prob sums (R,), target counts (R,))`` in float32.
    """
    got = logits_logps(logits, labels)
    return got.sums(), got.counts()


@dataclass
class DPOOutput:
    """What one DPO forward measured (per pair, detached)."""

    logps: torch.Tensor      # (B, 2) chosen, rejected
    rewards: torch.Tensor    # (B, 2)


class DPOTask(PairTask):
    """Preference pairs ``{prompt, chosen, rejected}``: one target per pair (the pair's loss).

    Examples are ``{"chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"}`` and,
    with a precomputed reference, ``"ref_logps"`` ``[chosen, rejected]``
    (:mod:`rankwise.tasks.pairs` builds them; the records, batch, target count, evaluation
    slices and log-probs are :class:`~rankwise.tasks.pair_task.PairTask`'s).

    Args:
        config: The ``task:`` section (default: :class:`DPOConfig`).
    """

    name = "dpo"

    def __init__(self, config: DPOConfig | None = None) -> None:
        super().__init__(config or DPOConfig())
        self.snapshot: WeightSnapshot | None = None  # the ``initial`` reference's weights

    def loss_sum(self, model, batch):
        """Summed per-pair loss; the reference is ``batch["ref_logps"]``, or the model with its
        adapters disabled or its initial weights swapped in (no gradient)."""
        policy, lengths, _ = self.sequence_logps(model, batch)
        ref = batch.get("ref_logps")
        if ref is None:
            with torch.no_grad(), reference(model, self.snapshot):
                ref, _, _ = self.sequence_logps(model, batch)
        c = self.config
        losses, rewards = dpo_losses(policy, ref.to(policy.device), lengths, c.losses(), c.beta,
                                     c.label_smoothing, c.loss_weights, c.discopop_tau)
        output = DPOOutput(policy.detach(), rewards)
        if model.training:
            add_pair_stats(self._sums, output.rewards, output.logps)
        return losses.sum(), output

    def step_metrics(self) -> dict[str, float]:
        """Means over the pairs of the training forwards since the last call (this process's)."""
        sums, self._sums = self._sums, {}
        return pair_means(sums, "")

    def eval_update(self, stats, batch, output, loss_sum):
        """Loss sum, pairs, and the reward / log-prob sums."""
        super().eval_update(stats, batch, output, loss_sum)
        add_pair_stats(stats, output.rewards, output.logps)

    def eval_metrics(self, stats):
        """``eval_loss`` (mean per pair), ``eval_reward_accuracy`` (share of pairs whose chosen
        reward is higher), ``eval_reward_margin`` and the mean rewards and log-probs."""
        n = max(stats.get("targets", 0.0), 1.0)
        return {"eval_loss": stats.get("loss", 0.0) / n, **pair_means(stats, "eval_")}

    def prepare(self, model: nn.Module, datasets: list, trains_full: bool, batch_size: int,
                device: str) -> str:
        """Switch dropout off (``task.disable_dropout``), resolve ``task.reference`` and, for ``precomputed``, store the reference log-probs of
        the model as it is now (before the first step) with each dataset (``ref_logps``); for
        ``initial``, copy its trainable tensors (:class:`~rankwise.tasks.reference.WeightSnapshot`).

        Returns:
            The reference in force (``adapters-off``, ``precomputed`` or ``initial``).

        Raises:
            RankwiseError: ``initial`` for an adapter trained from scratch.
        """
        return prepare_reference(self, model, datasets, trains_full,
                                 lambda data: reference_logps(self, model, data, batch_size, device))


def reference_logps(task: DPOTask, model: nn.Module, data: Any, batch_size: int, device: str) -> list:
    """``[[chosen, rejected], ...]`` completion log-probs of ``model`` over every pair of ``data``
    (in eval mode, so dropout does not enter the reference;
    :func:`rankwise.tasks.reference.precompute_logps`)."""
    return precompute_logps(task, model, data, batch_size, device, lambda batch: task.sequence_logps(model, batch)[0])


__all__ = ["DPOConfig", "DPOTask", "DPOOutput", "LOSSES", "completion_logps", "dpo_losses",
           "reference_logps"]
