"""The ``rloo`` task: REINFORCE Leave-One-Out on prompts with reward functions.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
Human Feedback in LLMs" (ACL 2024), the RLOO estimator; its baseline is Kool et al. 2019's
("Buy 4 REINFORCE Samples, Get a Baseline for Free!"). For each prompt ``x`` the policy samples
``k`` completions ``y_1..y_k`` (``task.num_generations``), and each gets the advantage of its
reward over the mean reward of the *other* ``k - 1``::

    A_i = R_i - 1/(k-1) sum_{j != i} R_j         R_i = r(x, y_i) - beta sum_t (logp_t - ref_t)

with ``r`` the weighted reward functions and the KL penalty the first-order log-ratio of the
sampling policy to the reference, summed over the completion's tokens (no gradient flows
through it: it is part of the reward). The loss is over whole sequences, ``s_i = sum_t logp_t``
(``log pi(y_i | x)``), with the sequence-level ratio ``rho_i = exp(s_i - s_i_old)``::

    l_i = -min(rho_i A_i, clip(rho_i, 1 - eps, 1 + eps_high) A_i)      loss = mean_i l_i

over the step's completions (every micro-batch of every process). ``s_i_old`` is the sampling
policy, one update per rollout, so ``rho = 1`` in value and the gradient is the paper's
``-(1/k) sum_i A_i grad log pi(y_i | x)``.

This is TRL 1.16's ``RLOOTrainer`` (its ``_generate_and_score_completions`` and
``_compute_loss``), which differs from the paper where said:

* the PPO-style clip of the sequence ratio (``epsilon``, ``epsilon_high``): the paper drops
  clipping; with one update per rollout it never binds, so the gradient is the paper's;
* every log-prob is taken at the sampling temperature, ``log_softmax(logits / T)``;
* ``normalize_advantages`` (off by default, as in TRL; not in the paper) standardises the
  advantages over the step, and ``reward_clip_range`` clamps the rewards before the penalty;
* TRL drops a completion every reward function returned ``None`` for from its siblings'
  baselines; rankwise refuses a reward that is not a finite number (one line naming the record).

Our own choice: ``disable_dropout`` on (TRL: off). Everything else — the decode loop
(:func:`rankwise.engine.generation.sample_groups`), the prompt records, the reward functions,
the reference (``task.reference``), ``samples.jsonl``, greedy evaluation (``eval_reward_mean``)
— is the ``grpo`` task's (:class:`~rankwise.tasks.grpo.task.GRPOTask`): RLOO replaces its
advantage (:meth:`RLOOTask.advantages`), its target count and its loss.
"""
from __future__ import annotations

import torch
from torch import nn

from rankwise.tasks.grpo.task import GRPOTask, token_logps
from rankwise.tasks.rloo.config import RLOOConfig


def leave_one_out(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """``r_i - mean of the other k - 1 rewards of its prompt`` per completion.

    Args:
        rewards: ``(B * k,)`` rewards, each prompt's ``k`` completions together.
        k: Completions per prompt (>= 2).

    Returns:
        ``(B * k,)`` advantages.
    """
    grouped = rewards.view(-1, k)                                   # (B, k)
    baseline = (grouped.sum(1, keepdim=True) - grouped) / (k - 1)   # (B, k): the others' mean
    return (grouped - baseline).reshape(-1)


def _all_sum(values: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(values)
    return values


def normalized(advantages: list[torch.Tensor]) -> list[torch.Tensor]:
    """``(A - mean) / (std + 1e-4)`` over every tensor of ``advantages`` (the step's micro-batches)
    and every process, std with Bessel's correction (TRL's ``normalize_advantages``)."""
    flat = torch.cat(advantages)
    stats = _all_sum(torch.stack([flat.sum(), torch.tensor(float(flat.numel()), device=flat.device)]))
    mean, n = stats[0] / stats[1], stats[1]
    squares = _all_sum(((flat - mean) ** 2).sum().reshape(1))[0]
    std = torch.sqrt(squares / (n - 1))
    return [(a - mean) / (std + 1e-4) for a in advantages]


class RLOOTask(GRPOTask):
    """Prompts + reward functions, ``k`` sampled completions each; targets: completions.

    Args:
        config: The ``task:`` section (default: :class:`RLOOConfig`).
    """

    name = "rloo"

    def __init__(self, config: RLOOConfig | None = None) -> None:
        super().__init__(config or RLOOConfig())

    def count_targets(self, batch):
        """Completions (the loss is their mean); before the rollout, the completions to come."""
        if "completion_mask" not in batch:
            return int(batch["input_ids"].shape[0]) * self.config.num_generations
        return int(batch["completion_mask"].shape[0])

    def completion_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(R, C)`` log-probs of the completion tokens at the sampling temperature (every
        policy log-prob of the task goes through here; the reference's through GRPO's rollout),
        in chunks of ``loss_chunk_tokens`` (GRPO's attribute) when set: the full logits are never
        formed, and padding columns hold 0 (the completion mask drops them either way)."""
        return token_logps(model, batch, self.config.temperature, self.loss_chunk_tokens)

    def advantages(self, model: nn.Module, rows: dict[str, torch.Tensor], rewards: torch.Tensor) -> torch.Tensor:
        """The leave-one-out advantage of each completion's KL-penalised reward.

        Args:
            model: The policy (under ``torch.no_grad``: called inside the rollout).
            rows: The prompt + completion rows (``ref_logps`` with ``beta > 0``).
            rewards: ``(B * k,)`` weighted rewards.

        Returns:
            ``(B * k,)`` advantages (before ``normalize_advantages``, which needs the whole step).
        """
        c = self.config
        if c.reward_clip_range is not None:
            rewards = rewards.clamp(float(c.reward_clip_range[0]), float(c.reward_clip_range[1]))
        if c.beta != 0.0:
            mask = rows["completion_mask"].float()
            kl = (self.completion_logps(model, rows) - rows["ref_logps"]) * mask   # (R, C): k1 estimate
            rewards = rewards - c.beta * kl.sum(-1).to(rewards.device)
            self._sums["kl"] = self._sums.get("kl", 0.0) + float(kl.sum())
            self._sums["kl_tokens"] = self._sums.get("kl_tokens", 0.0) + float(mask.sum())
        return leave_one_out(rewards, c.num_generations)

    def before_step(self, model: nn.Module, batches: list[dict], step: int, seed: int) -> list[dict]:
        """GRPO's rollout of every micro-batch (the same seeds), then, with
        ``normalize_advantages``, the advantages standardised over the whole step (and the
        step's ``samples.jsonl`` lines given the standardised values)."""
        start = len(self.samples)
        out = super().before_step(model, batches, step, seed)
        if self.config.normalize_advantages and out:
            out = self._normalize(out)
            flat = torch.cat([b["advantages"] for b in out]).tolist()
            for sample, value in zip(self.samples[start:], flat):
                sample["advantage"] = value
        return out

    @staticmethod
    def _normalize(batches: list[dict]) -> list[dict]:
        for b, adv in zip(batches, normalized([b["advantages"] for b in batches])):
            b["advantages"] = adv
        return batches

    def loss_sum(self, model, batch):
        """The summed RLOO loss over the batch's completions (see the module docstring; divided
        by the step's :meth:`count_targets` it is TRL's loss). In eval mode: greedy completions
        and minus their summed reward."""
        if not model.training:
            return self._eval(model, batch)
        c = self.config
        if "completion_mask" not in batch:
            batch = self.rollout(model, batch)
            if c.normalize_advantages:
                batch = self._normalize([batch])[0]
        mask = batch["completion_mask"].float()
        seq = (self.completion_logps(model, batch) * mask).sum(-1)          # (R,): log pi(y | x)
        ratio = torch.exp(seq - seq.detach())  # pi / pi_old: one update per rollout (TRL's rule)
        eps_high = c.epsilon if c.epsilon_high is None else c.epsilon_high
        adv = batch["advantages"]
        loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - c.epsilon, 1 + eps_high) * adv)
        return loss.sum(), None


__all__ = ["RLOOConfig", "RLOOTask", "leave_one_out", "normalized"]
