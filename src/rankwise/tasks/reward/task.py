"""The ``reward`` task: a reward model trained on ``{prompt, chosen, rejected}`` pairs.

A sequence classifier with one output (``AutoModelForSequenceClassification``,
``num_labels=1``) scores a whole sequence: ``r(x, y)`` is its head (``score``) at the last token
that is not padding, as transformers pools it. For a pair with chosen ``y_w`` and rejected
``y_l`` the loss is Bradley-Terry's negative log-likelihood of the preference::

    l = -log sigma(r(x, y_w) - r(x, y_l) - m) + eta (r(x, y_w) + r(x, y_l))^2

Ouyang et al. 2022, "Training language models to follow instructions with human feedback"
(InstructGPT), eq. 1, with Llama 2's margin ``m`` (Touvron et al. 2023, "Llama 2: Open
Foundation and Fine-Tuned Chat Models", eq. 2: a record's ``margin``, e.g. larger for pairs
rated far apart; 0 without one) and the centring term ``eta`` of Eisenstein et al. 2023,
"Helping or Herding? Reward Model Ensembles Mitigate but do not Eliminate Reward Hacking",
eq. 2 (``task.center_rewards_coefficient``; 0: off). The batch loss is the mean over pairs,
exactly TRL 1.16's ``RewardTrainer.compute_loss``. Where TRL differs from the papers we follow
TRL: InstructGPT averages the ``K choose 2`` comparisons of one prompt as one batch element,
TRL (and this task) takes every pair on its own.

The pairs are the pair tasks' records (:func:`rankwise.tasks.pairs.build_pair_data`: the
same prompt/completion encoding, chat templates and left cut of the prompt; TRL instead
tokenizes ``prompt + chosen`` as one text and drops pairs over ``max_length``). The head trains
beside any adapter (PEFT's ``modules_to_save``; :func:`rankwise.core.inject.default_heads`), so
``rankwise export --format peft`` writes a ``SEQ_CLS`` adapter with ``modules_to_save:
[score]`` that PEFT loads onto ``AutoModelForSequenceClassification(num_labels=1)``. A batch
holds the chosen rows, then the rejected rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.configs import bounded
from rankwise.engine.task import Task, TaskConfig
from rankwise.errors import RankwiseError
from rankwise.tasks.common import lm_example, write_records
from rankwise.tasks.pair_task import pair_run_problems
from rankwise.tasks.pairs import PairData, build_pair_data, by_pair, collate_pairs
from rankwise.tasks.reference import disable_dropout

MARGIN = "margin"  # the key a pair's margin travels under (whatever task.margin_field names)


@dataclass
class RewardConfig(TaskConfig):
    """The ``task:`` section of ``task: {name: reward}``.

    Attributes:
        name: ``reward``.
        margin_field: The record field holding a pair's margin ``m`` (Llama 2, eq. 2), used
            when the data has it (every record then needs a number there); ``null``: no margin.
        center_rewards_coefficient: ``eta`` of the centring term ``eta (r_w + r_l)^2`` that
            pulls the rewards towards mean 0 (Eisenstein et al. 2023, eq. 2; TRL's
            ``center_rewards_coefficient``, which recommends 0.01); 0: off (TRL's ``None``).
        disable_dropout: Set every dropout of the model to ``p = 0`` before training (TRL's
            ``RewardConfig`` default), so a pair's two forwards see one network.
    """

    name: str = "reward"
    margin_field: Union[str, None] = MARGIN
    center_rewards_coefficient: float = bounded(0.0, ge=0, lt=math.inf, hint="(0: off; TRL recommends 0.01)")
    disable_dropout: bool = True

    def problems(self) -> list[str]:
        """Return value errors."""
        out = []  # center_rewards_coefficient's range is declared on the field
        if self.margin_field is not None and not self.margin_field.strip():
            out.append("margin_field: got an empty name; name the record field or set it to null")
        return out

    def run_problems(self, run: Any) -> list[str]:
        """Pairs are scored whole by a one-output head: packing, samples, prompt targets, a
        length schedule, a supervised-fine-tuning record layout and another head size are
        refused."""
        d = run.data
        out = pair_run_problems(self.name, run, scored="pairs are scored whole, one reward per sequence")
        if d.format in ("alpaca", "sharegpt"):
            base = "prompt-completion" if d.format == "alpaca" else "chat"
            out.append(f"data.format: {d.format} is a record layout for supervised fine-tuning; "
                       f"task.name: reward reads {{prompt, chosen, rejected}} pairs: use data.format: "
                       f"{base} and name the fields (data.prompt_field, ...)")
        if run.model.num_labels not in (None, 1):
            out.append(f"model.num_labels: got {run.model.num_labels}; a reward model has one output "
                       "(num_labels=1): remove model.num_labels")
        return out


def reward_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                  center: float = 0.0) -> torch.Tensor:
    """Per-pair Bradley-Terry losses ``-log sigma(r_w - r_l - m) + eta (r_w + r_l)^2``.

    Args:
        chosen: ``(B,)`` rewards of the chosen sequences.
        rejected: ``(B,)`` rewards of the rejected ones.
        margin: ``(B,)`` margins ``m`` (Llama 2, eq. 2), or ``None`` (0).
        center: ``eta``, the centring coefficient (0: no term).

    Returns:
        ``(B,)`` losses; their mean is TRL 1.16's ``RewardTrainer`` loss.
    """
    h = chosen - rejected
    if margin is not None:
        h = h - margin
    out = -F.logsigmoid(h)
    if center:
        out = out + center * (chosen + rejected) ** 2
    return out


@dataclass
class RewardOutput:
    """What one reward forward measured (per pair, detached)."""

    rewards: torch.Tensor    # (B, 2) chosen, rejected


class RewardTask(Task):
    """Preference pairs scored by a one-output sequence classifier: one target per pair.

    Examples are the pair tasks' pairs (``chosen_ids``, ``rejected_ids``, their labels,
    unused here) with an optional ``margin``.

    Args:
        config: The ``task:`` section (default: :class:`RewardConfig`).
    """

    name = "reward"
    auto_class = "AutoModelForSequenceClassification"
    uses_labels = True  # a classifier head (one output: the data's label_names is ["reward"])

    def __init__(self, config: RewardConfig | None = None) -> None:
        super().__init__(config or RewardConfig())
        self._sums: dict[str, float] = {}

    @classmethod
    def example(cls, folder):
        """``tiny-llama`` preferring a function's body to ``pass`` (12 pairs, with margins)."""
        pairs = [{"prompt": f"def f{i}(x):\n", "chosen": f"    return x + {i}", "rejected": "    pass",
                  "margin": 0.5 * (i % 3)} for i in range(12)]
        return lm_example(folder, {"name": cls.name, "center_rewards_coefficient": 0.01},
                          data={"source": write_records(Path(folder) / "pairs.jsonl", pairs),
                                "max_length": 24, "eval_fraction": 0.25})

    def records(self, data_cfg, tokenizer, progress=False):
        """The ``data:`` section's preference pairs (:func:`rankwise.tasks.pairs.build_pair_data`),
        each with its ``task.margin_field`` value when the data has the field.

        Raises:
            RankwiseError: A margin that is missing or not a finite number.
        """
        field = self.config.margin_field
        keep = (field,) if field else ()
        datasets = build_pair_data(data_cfg, tokenizer, progress, keep=keep)
        for data in datasets:
            data.label_names = ["reward"]  # the head's one output (model.num_labels: 1)
            if field:
                _take_margins(data, field, data_cfg.source)
        return datasets

    def collate(self, items, pad_id):
        """Rows ``0..B-1`` are the chosen sequences, ``B..2B-1`` the rejected ones (right-padded,
        as TRL's ``DataCollatorForPreference``); ``margin`` ``(B,)`` when every pair has one."""
        batch = collate_pairs(items, pad_id, labels=False)          # (2B, T)
        if items and all(MARGIN in it for it in items):
            batch[MARGIN] = torch.tensor([float(it[MARGIN]) for it in items], dtype=torch.float32)
        return batch

    def count_targets(self, batch):
        """One target per pair."""
        return int(batch["input_ids"].shape[0]) // 2

    def pair_rewards(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """``(rewards (B, 2), output)``: the head's score of every chosen and rejected sequence.

        Raises:
            RankwiseError: The model's head has more than one output.
        """
        out, _ = self._forward(model, {k: v for k, v in batch.items() if k != MARGIN})
        logits = out.logits                                         # (2B, num_labels): pooled
        if logits.dim() != 2 or logits.shape[-1] != 1:
            raise RankwiseError(f"a reward model has one output per sequence (num_labels=1); this "
                                f"head has {logits.shape[-1]}: point model.path at a base model or a "
                                "reward model, and remove model.num_labels")
        return by_pair(logits[:, 0].float()), out                   # (2B,) -> (B, 2)

    def loss_sum(self, model, batch):
        """Summed per-pair loss (:func:`reward_losses`)."""
        rewards, _ = self.pair_rewards(model, batch)
        margin = batch.get(MARGIN)
        losses = reward_losses(rewards[:, 0], rewards[:, 1],
                               None if margin is None else margin.to(rewards.device),
                               self.config.center_rewards_coefficient)
        output = RewardOutput(rewards.detach())
        if model.training:
            _add(self._sums, output)
        return losses.sum(), output

    def prepare(self, model: nn.Module, datasets: list, trains_full: bool, batch_size: int,
                device: str) -> None:
        """Switch dropout off (``task.disable_dropout``) and give the model the data's pad token
        id, which the head's pooling reads to find each row's last token (TRL does the same)."""
        if self.config.disable_dropout:
            disable_dropout(model)
        pad_ids = {int(d.pad_id) for d in datasets if d is not None and getattr(d, "pad_id", None) is not None}
        config = getattr(getattr(model, "module", model), "config", None)
        if len(pad_ids) == 1 and config is not None:
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            text.pad_token_id = pad_ids.pop()
        return None

    def step_metrics(self) -> dict[str, float]:
        """Means over the pairs of the training forwards since the last call (this process's)."""
        sums, self._sums = self._sums, {}
        return _means(sums, "")

    def eval_update(self, stats, batch, output, loss_sum):
        """Loss sum, pairs, and the reward sums and extremes."""
        super().eval_update(stats, batch, output, loss_sum)
        _add(stats, output)

    def eval_metrics(self, stats):
        """``eval_loss`` (mean per pair), ``eval_accuracy`` (share of pairs whose chosen reward is
        higher), ``eval_margin`` (mean ``r_w - r_l``), ``eval_mean_reward`` and the lowest and
        highest reward (TRL's metric names; TRL averages its batches' extremes)."""
        n = max(stats.get("targets", 0.0), 1.0)
        return {"eval_loss": stats.get("loss", 0.0) / n, **_means(stats, "eval_")}


def _take_margins(data: PairData, field: str, source: str) -> None:
    """Move each pair's ``field`` to ``margin`` as a float; refuse a missing or non-finite one."""
    if not any(field in p for p in data.pairs):
        return
    bad = []
    for pair in data.pairs:
        value = pair.pop(field, None)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or isinstance(value, bool):
            bad.append(value)
            continue
        pair[MARGIN] = number
    if bad:
        raise RankwiseError(f"{source}: {len(bad)} of {len(data.pairs)} pairs of a split have no "
                            f"numeric {field!r} (e.g. {bad[0]!r}); give every record a number there, "
                            f"or set task.margin_field: null")


def _add(stats: dict[str, float], output: RewardOutput) -> None:
    r = output.rewards.float()
    for key, value in (("pairs", r.shape[0]), ("correct", (r[:, 0] > r[:, 1]).sum()),
                       ("margin", (r[:, 0] - r[:, 1]).sum()), ("reward", r.sum())):
        stats[key] = stats.get(key, 0.0) + float(value)
    if r.numel():
        stats["min_reward"] = min(stats.get("min_reward", math.inf), float(r.min()))
        stats["max_reward"] = max(stats.get("max_reward", -math.inf), float(r.max()))


def _means(stats: dict[str, float], prefix: str) -> dict[str, float]:
    n = stats.get("pairs", 0.0)
    if not n:
        return {}
    return {prefix + "accuracy": stats["correct"] / n, prefix + "margin": stats["margin"] / n,
            prefix + "mean_reward": stats["reward"] / (2 * n), prefix + "min_reward": stats["min_reward"],
            prefix + "max_reward": stats["max_reward"]}


__all__ = ["MARGIN", "RewardConfig", "RewardOutput", "RewardTask", "reward_losses"]
