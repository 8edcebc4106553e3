"""The body of the pair tasks: what ``dpo``, ``orpo``, ``simpo``, ``reward`` and ``kto`` share
beyond their records (:mod:`rankwise.tasks.pairs`).

:class:`PairTask` is the task of ``{prompt, chosen, rejected}`` pairs scored by completion
log-probs (``dpo`` and the reference-free ``orpo`` / ``simpo``): its records, its batch (chosen
rows, then rejected rows), its target count (one per pair), evaluation in slices of whole pairs
and :meth:`PairTask.sequence_logps`. :func:`pair_run_problems` is what every task of whole
pairs or examples refuses in the run config; :func:`add_pair_stats` / :func:`pair_means` the
reward and log-prob metrics DPO, ORPO and SimPO log.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise.engine.task import Task
from rankwise.tasks.common import CausalLMTask, lm_example, write_records
from rankwise.tasks.pairs import build_pair_data, collate_pairs, pair_logps


def pair_run_problems(name: str, run: Any, scored: str = "pairs are scored whole, on their completions",
                      schedule: str | None = None, prompt_fix: str = "") -> list[str]:
    """What a task of whole pairs (or examples) refuses in the rest of the run config, each
    naming the fix: packing, samples, prompt targets and a length schedule do not apply.

    Args:
        name: The task's name (messages).
        run: The whole :class:`~rankwise.recipes.config.RunConfig`.
        scored: Why, in the message's parentheses.
        schedule: The message for a ``data.schedule`` (default: skrull schedules single sequences).
        prompt_fix: Added to the reason when ``data.train_on_prompt`` is the problem (ORPO's own switch).
    """
    d, out = run.data, []
    if d.packing or run.eval.samples or d.train_on_prompt:
        what = "data.packing" if d.packing else "eval.samples" if run.eval.samples else "data.train_on_prompt"
        fix = prompt_fix if what == "data.train_on_prompt" else ""
        out.append(f"{what} is not supported with task.name: {name} ({scored}{fix}); remove it")
    if d.schedule.name != "none":
        out.append(schedule or f"data.schedule: skrull schedules single sequences, and task.name: {name} "
                               "trains pairs; set data.schedule: none")
    return out


PAIR_METRICS = {"correct": "reward_accuracy", "margin": "reward_margin", "reward_chosen": "reward_chosen",
                "reward_rejected": "reward_rejected", "logps_chosen": "logps_chosen",
                "logps_rejected": "logps_rejected"}  # running sum -> logged mean per pair


def add_pair_stats(stats: dict[str, float], rewards: torch.Tensor, logps: torch.Tensor) -> None:
    """Add a batch's pairs, reward accuracy and margin, rewards and log-probs to ``stats``.

    Args:
        stats: Running sums (changed in place).
        rewards: ``(B, 2)`` chosen, rejected rewards.
        logps: ``(B, 2)`` chosen, rejected log-probs.
    """
    r, lp = rewards.float(), logps.float()
    for key, value in (("pairs", r.shape[0]), ("correct", (r[:, 0] > r[:, 1]).sum()),
                       ("margin", (r[:, 0] - r[:, 1]).sum()), ("reward_chosen", r[:, 0].sum()),
                       ("reward_rejected", r[:, 1].sum()), ("logps_chosen", lp[:, 0].sum()),
                       ("logps_rejected", lp[:, 1].sum())):
        stats[key] = stats.get(key, 0.0) + float(value)


def pair_means(stats: dict[str, float], prefix: str) -> dict[str, float]:
    """The means per pair of :func:`add_pair_stats`' sums (:data:`PAIR_METRICS`), named with
    ``prefix``; ``{}`` before any pair."""
    n = stats.get("pairs", 0.0)
    if not n:
        return {}
    return {prefix + name: stats.get(key, 0.0) / n for key, name in PAIR_METRICS.items()}


class PairTask(Task):
    """Body of the pair tasks scored by completion log-probs (``dpo``, ``orpo``, ``simpo``):
    ``{prompt, chosen, rejected}`` pairs, one target per pair.

    Examples are ``{"chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"}`` and,
    with a precomputed reference, ``"ref_logps"`` ``[chosen, rejected]``
    (:func:`rankwise.tasks.pairs.build_pair_data` builds them). Subclasses set ``name`` and implement the loss.

    Args:
        config: The ``task:`` section.
    """

    auto_class = "AutoModelForCausalLM"
    eval_logits_bytes: int = CausalLMTask.eval_logits_bytes
    # Completion positions per chunk of the log-probs (:mod:`rankwise.tasks.logprobs`); 0 = the
    # whole logits at once. ``rankwise train`` sets it from ``train.loss_chunk_tokens``.
    loss_chunk_tokens: int = 0

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._sums: dict[str, float] = {}

    @classmethod
    def example(cls, folder):
        """``tiny-llama`` preferring a function's body to ``pass`` (12 pairs)."""
        pairs = [{"prompt": f"def f{i}(x):\n", "chosen": f"    return x + {i}", "rejected": "    pass"}
                 for i in range(12)]
        return lm_example(folder, {"name": cls.name, "beta": 0.2},
                          data={"source": write_records(Path(folder) / "pairs.jsonl", pairs),
                                "max_length": 24, "eval_fraction": 0.25})

    def records(self, data_cfg, tokenizer, progress=False):
        """The ``data:`` section's preference pairs (:func:`rankwise.tasks.pairs.build_pair_data`)."""
        return build_pair_data(data_cfg, tokenizer, progress)

    def collate(self, items, pad_id):
        """:func:`rankwise.tasks.pairs.collate_pairs` (rows ``0..B-1`` chosen, ``B..2B-1`` rejected), with
        ``ref_logps`` ``(B, 2)`` when every pair carries them."""
        batch = collate_pairs(items, pad_id)
        if all("ref_logps" in it for it in items):
            batch["ref_logps"] = torch.tensor([list(it["ref_logps"]) for it in items], dtype=torch.float32)
        return batch

    def count_targets(self, batch):
        """One target per pair."""
        return int(batch["input_ids"].shape[0]) // 2

    def sequence_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``(completion log-probs (B, 2), completion tokens (B, 2), output)`` of ``model``, in
        chunks of ``loss_chunk_tokens`` completion positions when set (the full logits are never
        formed; the output's ``logits`` is then a zero-width placeholder)."""
        inputs = {k: v for k, v in batch.items() if k != "ref_logps"}
        return pair_logps(model, lambda: self._forward(model, inputs), self.loss_chunk_tokens)

    def eval_parts(self, model, batch):
        """Slices of whole pairs (chosen row ``i`` with rejected row ``B + i``) whose float32
        logits fit in ``eval_logits_bytes``; sums and counts add up to the batch's."""
        pairs, width = self.count_targets(batch), batch["input_ids"].shape[1]
        rows = CausalLMTask.eval_rows(model, width, self.eval_logits_bytes)
        step = None if rows is None else max(1, rows // 2)         # two rows per pair
        if step is None or step >= pairs:
            return [batch]
        parts = []
        for i in range(0, pairs, step):
            j = min(pairs, i + step)
            rows = torch.cat([torch.arange(i, j), torch.arange(pairs + i, pairs + j)]).to(batch["input_ids"].device)
            part = {k: v[rows] for k, v in batch.items() if k != "ref_logps"}
            if "ref_logps" in batch:
                part["ref_logps"] = batch["ref_logps"][i:j]
            parts.append(part)
        return parts


__all__ = ["PAIR_METRICS", "PairTask", "add_pair_stats", "pair_means", "pair_run_problems"]
