"""Two reference points that inject nothing: ``full`` fine-tuning and the ``frozen`` encoder.

``full`` trains every weight (the setting low-rank optimizers such as GaLore target);
``frozen`` trains only the task head (the linear-probe baseline of the demo).

``full`` with ``select`` fine-tunes only a ``fraction`` of the output neurons of the targeted
linear layers (and the task head): Model Shapley (NeurIPS 2025, §5.1, "fine-tuning the top-10 %
neurons") ranks neurons by φ = -g⊙θ + ½ θ⊙(Fθ) summed per neuron
(:func:`rankwise.core.diagnostics.neuron_scores`); ``grad``, ``grad_weight`` and ``random`` are
its first-order and random anchors. Gradient masks zero the other rows, so with AdamW's default
``weight_decay: 0`` those rows never move (a non-zero decay would still shrink them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import torch
from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import train_only
from rankwise.core.diagnostics import neuron_scores
from rankwise.core.inject import default_heads, find_targets
from rankwise.core.weights import base_layer, is_conv1d, storage_param


@dataclass
class FullConfig:
    """Full fine-tuning: every parameter trains.

    Attributes:
        name: Registry name.
        select: ``None`` trains everything; ``shapley`` / ``grad`` / ``grad_weight`` /
            ``random`` trains only the top ``fraction`` of the targeted layers' output neurons
            by that score (one global ranking over all targets), plus the task head.
        fraction: Share of neurons that train when ``select`` is set, in (0, 1].
        select_targets: The linear layers whose neurons are ranked (``select`` only; named
            apart from LoRA's ``targets``, which a compare row would otherwise carry over).
        seed: Seed of ``random``.
    """

    name: str = "full"
    select: Optional[Literal["shapley", "grad", "grad_weight", "random"]] = None
    fraction: float = 0.1
    select_targets: Union[str, list[str]] = "all-linear"
    seed: int = 0

    def problems(self) -> list[str]:
        """Config problems, each one line naming the fix."""
        if not 0 < self.fraction <= 1:
            return [f"method.fraction: got {self.fraction!r}; expected a share in (0, 1], e.g. 0.1"]
        return []


@dataclass
class FrozenConfig:
    """Frozen base: only ``modules_to_save`` train (default: the classification head).

    Attributes:
        name: Registry name.
        modules_to_save: Modules that train; ``None`` means the task head.
    """

    name: str = "frozen"
    modules_to_save: Union[list[str], None] = field(default=None)


@dataclass
class Selection:
    """Which neurons train (``select``); ``rankwise train`` writes it as ``selection.json``."""

    kind: str
    fraction: float
    neurons: dict[str, list[int]]

    def write_artifacts(self, run_dir: Path) -> None:
        """Write ``run_dir/selection.json``."""
        (Path(run_dir) / "selection.json").write_text(json.dumps(
            {"select": self.kind, "fraction": self.fraction, "neurons": self.neurons}))


def _model_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def apply_full(model: nn.Module, config: FullConfig, adapter_name: str = "default", batches: Any = None,
               loss_fn: Callable[[nn.Module, dict], torch.Tensor] | None = None) -> Selection | None:
    """Make every parameter trainable, or with ``select`` only the top neurons (gradient masks).

    Args:
        model: The model.
        config: Its :class:`FullConfig`.
        adapter_name: Ignored (there is no adapter).
        batches: Calibration batches (read only with ``select``).
        loss_fn: ``loss_fn(model, batch)`` mean loss (default ``model(**batch).loss``).

    Returns:
        The :class:`Selection`, or ``None`` without ``select``.

    Raises:
        ValueError: If ``select`` is set and no calibration batch is given.
    """
    for p in model.parameters():
        p.requires_grad_(True)
    if config.select is None:
        return None
    if batches is None and config.select != "random":  # core.io.rebuild passes none (--resume)
        raise ValueError(f"method.select: {config.select} cannot be rebuilt without its calibration "
                         "batches (a select run cannot be resumed yet); start a new run")
    batches = list(batches or [])
    if not batches and config.select != "random":
        raise ValueError(f"method.select: {config.select} needs calibration batches "
                         "(train.calibration_batches >= 1)")
    mods = dict(model.named_modules())
    paths = find_targets(model, config.select_targets, what="method.select_targets")
    weights = {p: storage_param(mods[p]) for p in paths}
    transposed = {p for p in paths if is_conv1d(base_layer(mods[p]))}
    loss_fn = loss_fn or _model_loss
    scores = neuron_scores(config.select, weights, batches, lambda b: loss_fn(model, b), transposed, config.seed)
    flat = torch.cat([scores[p] for p in paths])
    k = max(1, int(round(config.fraction * len(flat))))
    keep = torch.zeros(len(flat), dtype=torch.bool)
    keep[flat.topk(k).indices] = True
    for p in model.parameters():
        p.requires_grad_(False)
    for head in default_heads(model):  # a classification head is new: it always trains
        for p in getattr(model, head).parameters():
            p.requires_grad_(True)
    chosen, start = {}, 0
    for path in paths:
        rows = keep[start:start + len(scores[path])]
        start += len(scores[path])
        chosen[path] = rows.nonzero().flatten().tolist()
        layer = base_layer(mods[path])
        mask = rows.float()[None, :] if path in transposed else rows.float()[:, None]  # storage layout
        for param, m in ((layer.weight, mask), (getattr(layer, "bias", None), rows.float())):
            if param is None or not rows.any():
                continue
            param.requires_grad_(True)
            param.register_hook(lambda g, m=m.to(param.device): g * m)
    return Selection(config.select, config.fraction, chosen)


def apply_frozen(model: nn.Module, config: FrozenConfig, adapter_name: str = "default") -> None:
    """Freeze the model except the task head (or ``config.modules_to_save``)."""
    train_only(model, config, adapter_name)


registry.register("method", "full", FullConfig, apply_full, needs_batches=True,
                  summary="full fine-tuning (every weight trains; select: only the top neurons)",
                  trains="full")
registry.register("method", "frozen", FrozenConfig, apply_frozen,
                  summary="frozen base, only the task head trains (linear probe)")
