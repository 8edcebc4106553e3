"""What a model is trained to do: a :class:`Task` owns collation, labels, loss and metrics.

Every place that turns examples into a loss (``rankwise train``, federated clients, compare,
benchmarks, GoRA's calibration) asks the run's task; nothing branches on a task string. A task
is registered once (kind ``"task"``); instruction formats are data formats of ``causal-lm``.

Losses are returned as *sums* over the batch's targets together with the number of targets,
so the engine can normalise a step by the targets of the whole step (gradient accumulation
over variable-length sequences gives the same update as one big batch).
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.core.protocol import transform_inputs
from rankwise.engine.chunked_loss import chunked_forward
from rankwise.errors import RankwiseError

IGNORE = -100  # label of positions that carry no loss (padding, prompts, virtual tokens)
WEIGHT_KEYS = ("weights", "token_weights")  # per-example / per-token loss weights (data.select)


def pad(seqs: list[list[int]], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad integer sequences into ``(ids (B, T), mask (B, T))``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[row, : len(s)] = 1
    return ids, mask


def add_weights(batch: dict[str, torch.Tensor], items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Add ``weights`` (B,) and ``token_weights`` (B, T) when the items carry ``weight`` /
    ``token_weight`` (selected data with ``data.select.weights``); padding weighs 0."""
    if items and all("weight" in it for it in items):
        batch["weights"] = torch.tensor([float(it["weight"]) for it in items], dtype=torch.float32)
    if items and all("token_weight" in it for it in items):
        width = batch["input_ids"].shape[1]
        tw = torch.zeros((len(items), width), dtype=torch.float32)
        for row, it in enumerate(items):
            tw[row, : len(it["token_weight"])] = torch.as_tensor(it["token_weight"], dtype=torch.float32)
        batch["token_weights"] = tw
    return batch


class Task:
    """Base class. Subclasses set the class attributes and implement the four methods.

    Attributes:
        name: The ``model.task`` value.
        auto_class: The transformers ``AutoModel*`` class that loads a model for the task.
        uses_labels: Records need a label field (``data.label_field``).
    """

    name: ClassVar[str] = ""
    auto_class: ClassVar[str] = ""
    uses_labels: ClassVar[bool] = False
    paired: ClassVar[bool] = False  # examples are preference pairs (rankwise.tasks.dpo.data)

    def collate(self, items: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
        """Turn examples (``{"input_ids": [...], ...}``) into padded model inputs + ``labels``."""
        raise NotImplementedError

    def count_targets(self, batch: dict[str, torch.Tensor]) -> int:
        """Number of loss terms in ``batch`` (examples, or predicted tokens)."""
        raise NotImplementedError

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """Forward ``batch`` (through the model's input adapters) and return
        ``(sum of per-target losses, model output)``."""
        raise NotImplementedError

    def eval_update(self, stats: dict[str, float], batch: dict[str, torch.Tensor], output: Any,
                    loss_sum: torch.Tensor) -> None:
        """Add one evaluation batch to the running sums in ``stats``."""
        stats["loss"] = stats.get("loss", 0.0) + float(loss_sum)
        stats["targets"] = stats.get("targets", 0.0) + self.count_targets(batch)

    def eval_metrics(self, stats: dict[str, float]) -> dict[str, float]:
        """Final metrics (``eval_loss`` and the task's own) from the running sums."""
        raise NotImplementedError

    def eval_parts(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The pieces of an evaluation batch that are forwarded one at a time (rows of the
        padded batch, so every sum and count is unchanged); default: the whole batch."""
        return [batch]

    def step_metrics(self) -> dict[str, float]:
        """The task's own training metrics since the last call (logged with each step's loss);
        default: none."""
        return {}

    def prepare(self, model: nn.Module, datasets: list, trains_full: bool, batch_size: int,
                device: str) -> str | None:
        """Called once the model is ready, before training (DPO precomputes its reference
        here); default: nothing."""
        return None

    def before_step(self, model: nn.Module, batches: list[dict[str, torch.Tensor]], step: int,
                    seed: int) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of training step ``step`` as the loss reads them (GRPO samples its
        completions here, so the step's targets are known before the backward); default: as
        they are."""
        return batches

    def mean_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean loss per target of one batch (GoRA's calibration, simple loops)."""
        total, _ = self.loss_sum(model, batch)
        return total / max(self.count_targets(batch), 1)

    @staticmethod
    def _forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, dict]:
        batch = transform_inputs(model, batch)
        inputs = {k: v for k, v in batch.items() if k != "labels" and k not in WEIGHT_KEYS}
        if "position_ids" in inputs:  # packed: restarting positions give the block mask
            inputs.pop("attention_mask", None)
            inputs["use_cache"] = False
        return model(**inputs), batch


class ClassificationTask(Task):
    """Sequence classification: one label per example, cross-entropy, accuracy."""

    name = "classification"
    auto_class = "AutoModelForSequenceClassification"
    uses_labels = True

    def collate(self, items, pad_id):
        """Pad ``input_ids``; ``labels`` is one class index per example."""
        ids, mask = pad([it["input_ids"] for it in items], pad_id)
        labels = torch.tensor([int(it["label"]) for it in items], dtype=torch.long)
        return add_weights({"input_ids": ids, "attention_mask": mask, "labels": labels}, items)

    def count_targets(self, batch):
        """One target per example."""
        return int(batch["labels"].shape[0])

    def loss_sum(self, model, batch):
        """Summed cross-entropy of the logits against the labels."""
        out, batch = self._forward(model, batch)
        logits = out.logits
        if logits.shape[-1] < 2:
            raise RankwiseError("a classification head with one output is a regression head; "
                                "the data needs at least two labels (check data.label_field)")
        if "weights" in batch:  # sum_i w_i CE_i (data.select.weights)
            per = F.cross_entropy(logits.float(), batch["labels"], reduction="none")
            return (per * batch["weights"]).sum(), out
        return F.cross_entropy(logits.float(), batch["labels"], reduction="sum"), out

    def eval_update(self, stats, batch, output, loss_sum):
        """Loss sum, examples, and correct predictions."""
        super().eval_update(stats, batch, output, loss_sum)
        stats["correct"] = stats.get("correct", 0.0) + float(
            (output.logits.argmax(-1) == batch["labels"]).sum())

    def eval_metrics(self, stats):
        """``eval_loss`` (mean cross-entropy) and ``eval_accuracy``."""
        n = max(stats.get("targets", 0.0), 1.0)
        return {"eval_loss": stats.get("loss", 0.0) / n, "eval_accuracy": stats.get("correct", 0.0) / n}


class CausalLMTask(Task):
    """Next-token prediction. Examples may carry their own ``labels`` (``-100`` where no loss
    is wanted, e.g. on a prompt); otherwise every real token is a target."""

    name = "causal-lm"
    auto_class = "AutoModelForCausalLM"
    # Evaluation forwards at most this many bytes of float32 logits (rows x T x vocab) at once.
    # 64 examples x 96 tokens x a 30k vocabulary are 750 MB, and the loss holds two more copies
    # (the shifted slice, log-softmax): the instruct example peaked at 2.85 GB for 2M parameters.
    eval_logits_bytes: int = 64 * 2**20
    # Target tokens per chunk of the loss (:mod:`rankwise.engine.chunked_loss`); 0 = the whole
    # logits at once. ``rankwise train`` sets it from ``train.loss_chunk_tokens``.
    loss_chunk_tokens: int = 0

    def collate(self, items, pad_id):
        """Pad ``input_ids``; labels are the example's own or its ids, ``-100`` on padding.

        Packed blocks (items with ``position_ids``) keep them; the padding tail gets positions
        restarting at 0, so it forms its own segment that no real token attends to.
        """
        ids, mask = pad([it["input_ids"] for it in items], pad_id)
        if all("labels" in it for it in items):
            labels, _ = pad([it["labels"] for it in items], IGNORE)
        else:
            labels = ids.masked_fill(mask == 0, IGNORE)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if all("position_ids" in it for it in items):
            width = ids.shape[1]
            batch["position_ids"] = torch.tensor(
                [list(it["position_ids"]) + list(range(width - len(it["position_ids"]))) for it in items],
                dtype=torch.long)
        return add_weights(batch, items)

    def count_targets(self, batch):
        """Tokens that are predicted: labels at positions 1.. that are not ``-100``."""
        return int((batch["labels"][:, 1:] != IGNORE).sum())

    def loss_sum(self, model, batch):
        """Summed next-token cross-entropy over the target tokens (in chunks of
        ``loss_chunk_tokens`` target tokens when set: the full logits are never formed, and the
        output's ``logits`` is then a placeholder without storage)."""
        if self.loss_chunk_tokens and not any(k in batch for k in WEIGHT_KEYS):  # weighted: whole logits
            done = chunked_forward(model, lambda: self._forward(model, batch), self.loss_chunk_tokens)
            if done is not None:
                return done[0], done[1]
        out, batch = self._forward(model, batch)
        logits = out.logits[:, :-1]                       # (B, T-1, V): predicts tokens 1..T-1
        labels = batch["labels"][:, 1:]                   # (B, T-1)
        weighted = any(k in batch for k in WEIGHT_KEYS)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                               ignore_index=IGNORE, reduction="none" if weighted else "sum")
        if weighted:  # sum_ij w_i v_ij CE_ij (data.select.weights; v: QCS's token weights)
            w = torch.ones_like(labels, dtype=torch.float32)
            if "weights" in batch:
                w = w * batch["weights"][:, None]
            if "token_weights" in batch:
                w = w * batch["token_weights"][:, 1:]
            loss = (loss.reshape(labels.shape) * w).sum()
        return loss, out

    def eval_parts(self, model, batch):
        """Row slices of ``batch`` whose float32 logits fit in ``eval_logits_bytes`` (at least
        one row each); the loss sums and target counts of the slices add up to the batch's."""
        rows, width = batch["input_ids"].shape
        step = self.eval_rows(model, width, self.eval_logits_bytes)
        if step is None or step >= rows:
            return [batch]
        return [{k: v[i:i + step] if v.dim() and v.shape[0] == rows else v for k, v in batch.items()}
                for i in range(0, rows, step)]

    @staticmethod
    def eval_rows(model: nn.Module, width: int, budget: int) -> int | None:
        """Rows of ``width`` tokens whose float32 logits fit in ``budget`` bytes (at least 1);
        ``None`` when the model's vocabulary size is unknown."""
        config = getattr(getattr(model, "module", model), "config", None)
        if config is not None and hasattr(config, "get_text_config"):
            config = config.get_text_config()
        vocab = getattr(config, "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 1:
            return None
        return max(1, budget // (width * vocab * 4))

    def eval_metrics(self, stats):
        """``eval_loss`` per target token and ``eval_perplexity``."""
        loss = stats.get("loss", 0.0) / max(stats.get("targets", 0.0), 1.0)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}
