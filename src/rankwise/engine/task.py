"""The task protocol: a :class:`Task` owns collation, labels, loss and metrics, and its
:class:`TaskConfig` (the run config's ``task:`` section) its settings and cross-checks.

Every place that turns examples into a loss (``rankwise train``, federated clients, compare,
benchmarks, GoRA's calibration) asks the run's task; nothing branches on a task string. The
tasks themselves are the :mod:`rankwise.tasks` family, each registered once (kind ``"task"``:
``registry.register("task", name, Config, TaskClass)``); instruction formats are data formats of
``causal-lm``.

Losses are returned as *sums* over the batch's targets together with the number of targets,
so the engine can normalise a step by the targets of the whole step (gradient accumulation
over variable-length sequences gives the same update as one big batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn
from rankwise.core.protocol import transform_inputs

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


@dataclass
class TaskConfig:
    """Base of a task's config: the run config's ``task:`` section, chosen by ``task.name`` from
    the registry (kind ``task``) as ``method:`` is. A task's config subclasses it, re-declares
    ``name`` and holds every default of the task.

    Attributes:
        name: The registered task (``rankwise list`` shows them).
        paths: Class attribute: the fields that hold a local path (a relative one is read from
            the config file's folder; a run folder stores it absolute).
    """

    paths: ClassVar[tuple[str, ...]] = ()

    name: str = ""

    def problems(self) -> list[str]:
        """Return value errors of the section alone (``"field: message"``); default: none."""
        return []

    def run_problems(self, run: Any) -> list[str]:
        """Return what this task refuses in the rest of the run config, each naming the fix;
        default: nothing.

        Args:
            run: The whole :class:`~rankwise.recipes.config.RunConfig` (every section has passed
                its own checks).
        """
        return []

    def read_from(self, folder: Path) -> None:
        """Told the folder of the config file this section was read from (GRPO imports
        ``module:function`` rewards from it); default: nothing."""


class Task:
    """Base class. Subclasses set the class attributes and implement the four methods.

    A task is built by its registered builder, the class itself, from its config
    (``Task(config)``; ``Task()``: the config's defaults).

    Attributes:
        name: The ``task.name`` value.
        auto_class: The transformers ``AutoModel*`` class that loads a model for the task.
        uses_labels: The model is a sequence classifier with a new head (``score``,
            ``classifier``: trained beside any adapter, never quantized): text records need a
            label field (``data.label_field``); a task with its own records sets the head's
            outputs through its data's ``label_names`` (the reward model: one).
        lm_loss: The loss is next-token cross-entropy on the data's token sequences, so
            perplexity measures it (``rankwise compress``'s evaluation, ``compress.restore``,
            ``rankwise transfer`` and ``data.question_free`` need such a task; a subclass of
            :class:`~rankwise.tasks.common.CausalLMTask` inherits it).
        from_adapter: Set by the train recipe when the run starts from ``model.adapter``.
        model_loader: Set by the train recipe: ``model_loader(path, device)`` loads another
            causal LM folder as the run loads ``model.path`` (the memory decoder's base);
            ``None`` outside a run.
        teacher_loader: Set by the train recipe: ``teacher_loader(path, device, dtype)`` loads
            a frozen teacher (a model folder, a finished run folder with its adapters merged,
            or a ``tiny-*`` test model) as ``(model in eval mode, tokenizer or None)``
            (:func:`rankwise.recipes.teacher.load_teacher`; the ``gkd`` task's teacher);
        run_loader: Set by the train recipe: ``run_loader(run_dir, device)`` rebuilds a
            finished run's trained model as ``rankwise export`` does
            (:func:`rankwise.recipes.export.load_run`) and returns ``(config, model, tokenizer)``,
            the model on ``device`` in eval mode (GRPO's reward model from a reward run);
            ``None`` outside a run.
    """

    name: ClassVar[str] = ""
    auto_class: ClassVar[str] = ""
    uses_labels: ClassVar[bool] = False
    lm_loss: ClassVar[bool] = False
    from_adapter: bool = False
    model_loader: Callable[[str, str], nn.Module] | None = None
    teacher_loader: Callable[[str, str, str], tuple[nn.Module, Any]] | None = None
    run_loader: Callable[[str, str], tuple[Any, nn.Module, Any]] | None = None

    def __init__(self, config: TaskConfig | None = None) -> None:
        self.config = config

    @classmethod
    def example(cls, folder: Path) -> dict | None:
        """A small run of this task on an in-code tiny model (``model.path: tiny-llama``, ...;
        :mod:`rankwise.testing`), its records written into ``folder``: the raw run config the
        task contract suite (``tests/tasks/test_task_contract.py``) collates, scores, evaluates,
        trains and resumes. ``None`` (the default): the task has none, which that suite reports.

        Args:
            folder: An empty folder for the example's data files.

        Returns:
            The raw run config (new spelling: a ``task:`` section), or ``None``.
        """
        return None

    def records(self, data_cfg: Any, tokenizer: Any, progress: bool = False) -> tuple[Any, Any] | None:
        """``(train, eval)`` examples the task builds from the ``data:`` section itself (DPO's
        pairs, GRPO's prompts), or ``None`` (the default): the records are then encoded as
        text by :func:`rankwise.data.text.build_data`, which asks this hook first.

        Args:
            data_cfg: The ``data:`` section.
            tokenizer: A transformers tokenizer.
            progress: Show ``datasets``' progress bars while reading.
        """
        return None

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

    def schedule(self, run: Any, model: nn.Module, train_data: Any, device: str,
                 distributed: bool = False) -> Any:
        """The engine's ``schedule`` when the task draws its own training examples (GRPO under
        ``data.order: gain-rl``: GAIN-RL's sampler), built on the first call and kept, so its
        state (saved in checkpoints) carries across the run's engines; default: ``None``, the
        run's draw order.

        Args:
            run: The whole :class:`~rankwise.recipes.config.RunConfig`.
            model: The prepared model.
            train_data: The training examples.
            device: Their device.
            distributed: Whether the run has several processes.
        """
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
