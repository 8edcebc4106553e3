"""The two plain tasks: sequence classification and next-token prediction (causal LM).

Both take a config with no settings but the name (:class:`ClassificationConfig`,
:class:`CausalLMConfig`); their records are the data layer's text encoding
(:func:`rankwise.data.text.build_data`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from rankwise import registry
from rankwise.engine.chunked_loss import chunked_forward
from rankwise.engine.task import IGNORE, WEIGHT_KEYS, Task, TaskConfig, add_weights, pad
from rankwise.errors import RankwiseError


TRAIN = {"steps": 2, "batch_size": 4, "eval_batch_size": 16, "save_every": 1, "log_every": 1,
         "progress": False}  # the examples' train: section (Task.example)
SNIPPETS = ["def add(a, b):\n    return a + b", "class Box:\n    items = []",
            "for key in sorted(table):\n    print(key)", "import os\nos.path.join(a, b)",
            "with open(path) as f:\n    data = f.read()", "if x is None:\n    raise ValueError(x)",
            "return [x * 2 for x in values]", "while queue:\n    queue.pop()"]


def write_records(path: Path, records: list[dict]) -> str:
    """Write ``records`` as JSON lines to ``path`` (an example's data file); returns the path."""
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def lm_example(folder: Path, task: dict, **sections: Any) -> dict:
    """The raw run config of a task example on ``tiny-llama`` over :data:`SNIPPETS` (8 records
    twice), LoRA r=4 on q/v, AdamW; ``sections`` replace whole sections (``data=...``)."""
    source = write_records(Path(folder) / "text.jsonl", [{"text": t} for t in SNIPPETS * 2])
    return {"model": {"path": "tiny-llama"}, "task": task,
            "data": {"source": source, "max_length": 24, "eval_fraction": 0.25},
            "method": {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"]},
            "optim": {"name": "adamw", "lr": 0.02}, "train": dict(TRAIN), **sections}


@dataclass
class ClassificationConfig(TaskConfig):
    """``task: {name: classification}``: a sequence-classification head, one label per record
    (``data.label_field``; ``model.num_labels``)."""

    name: str = "classification"

    def run_problems(self, run: Any) -> list[str]:
        """Token-level options (a data format other than ``text``, packing, samples) need a
        causal LM."""
        d = run.data
        if d.format != "text" or d.packing or run.eval.samples:
            what = ("data.packing" if d.packing else "eval.samples" if run.eval.samples
                    else f"data.format {d.format}")
            return [f"{what} needs task.name: causal-lm (got {self.name}); remove it or change the task"]
        return []


@dataclass
class CausalLMConfig(TaskConfig):
    """``task: {name: causal-lm}``: next-token prediction (pretraining, supervised fine-tuning
    through ``data.format``)."""

    name: str = "causal-lm"


class ClassificationTask(Task):
    """Sequence classification: one label per example, cross-entropy, accuracy.

    Args:
        config: The ``task:`` section (default: :class:`ClassificationConfig`).
    """

    name = "classification"
    auto_class = "AutoModelForSequenceClassification"
    uses_labels = True

    def __init__(self, config: ClassificationConfig | None = None) -> None:
        super().__init__(config or ClassificationConfig())

    @classmethod
    def example(cls, folder):
        """``tiny-bert`` telling snippets that define something (label 1) from the rest."""
        records = [{"text": t, "label": int(t.startswith(("def", "class")))} for t in SNIPPETS * 2]
        return {"model": {"path": "tiny-bert"}, "task": {"name": cls.name},
                "data": {"source": write_records(Path(folder) / "labels.jsonl", records),
                         "max_length": 24, "eval_fraction": 0.25},
                "method": {"name": "lora", "r": 4, "targets": ["query", "value"]},
                "optim": {"name": "adamw", "lr": 0.02}, "train": dict(TRAIN)}

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
    is wanted, e.g. on a prompt); otherwise every real token is a target.

    Args:
        config: The ``task:`` section (default: :class:`CausalLMConfig`).
    """

    name = "causal-lm"
    auto_class = "AutoModelForCausalLM"
    lm_loss = True
    # Evaluation forwards at most this many bytes of float32 logits (rows x T x vocab) at once.
    # 64 examples x 96 tokens x a 30k vocabulary are 750 MB, and the loss holds two more copies
    # (the shifted slice, log-softmax): the instruct example peaked at 2.85 GB for 2M parameters.
    eval_logits_bytes: int = 64 * 2**20
    # Target tokens per chunk of the loss (:mod:`rankwise.engine.chunked_loss`); 0 = the whole
    # logits at once. ``rankwise train`` sets it from ``train.loss_chunk_tokens``.
    loss_chunk_tokens: int = 0

    def __init__(self, config: CausalLMConfig | None = None) -> None:
        super().__init__(config or CausalLMConfig())

    @classmethod
    def example(cls, folder):
        """``tiny-llama`` on code snippets (:func:`lm_example`)."""
        return lm_example(folder, {"name": cls.name})

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

    def eval_update(self, stats, batch, output, loss_sum):
        """The loss sums, and the argmax hits of the target tokens: per token, and per sequence
        (every target token hit). A chunked loss's placeholder logits (stride 0, no storage)
        carry no argmax, so such a batch adds to the loss only."""
        super().eval_update(stats, batch, output, loss_sum)
        logits = getattr(output, "logits", None)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.stride(-1) == 0:
            return
        logits = logits[:, -batch["labels"].shape[1]:]    # (B, T, V): a prompt method's virtual
        labels = batch["labels"][:, 1:]                   # tokens come first; (B, T-1)
        target = labels != IGNORE
        hit = logits[:, :-1].argmax(-1) == labels         # (B, T-1)
        scored = target.any(1)                            # (B,): sequences with a target
        stats["hits"] = stats.get("hits", 0.0) + float((hit & target).sum())
        stats["hit_targets"] = stats.get("hit_targets", 0.0) + float(target.sum())
        stats["exact"] = stats.get("exact", 0.0) + float(((hit | ~target).all(1) & scored).sum())
        stats["sequences"] = stats.get("sequences", 0.0) + float(scored.sum())

    def eval_metrics(self, stats):
        """``eval_loss`` per target token and ``eval_perplexity``; where the logits were formed,
        ``eval_token_accuracy`` (target tokens that are the argmax) and ``eval_exact_match``
        (sequences whose every target token is: greedy decoding from the prompt reproduces the
        target exactly, its end-of-sequence token included)."""
        loss = stats.get("loss", 0.0) / max(stats.get("targets", 0.0), 1.0)
        out = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}
        if stats.get("sequences"):
            out["eval_token_accuracy"] = stats["hits"] / max(stats["hit_targets"], 1.0)
            out["eval_exact_match"] = stats["exact"] / stats["sequences"]
        return out


__all__ = ["CausalLMConfig", "CausalLMTask", "ClassificationConfig", "ClassificationTask", "lm_example",
           "write_records"]

registry.register("task", ClassificationTask.name, ClassificationConfig, ClassificationTask,
                  summary="classification (AutoModelForSequenceClassification; a label per record)")
registry.register("task", CausalLMTask.name, CausalLMConfig, CausalLMTask,
                  summary="causal-lm (AutoModelForCausalLM; next-token loss, data.format's SFT formats)")
