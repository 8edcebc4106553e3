"""Two reference points that inject nothing: ``full`` fine-tuning and the ``frozen`` encoder.

``full`` trains every weight (the setting low-rank optimizers such as GaLore target);
``frozen`` trains only the task head (the linear-probe baseline of the demo).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import train_only


@dataclass
class FullConfig:
    """Full fine-tuning: every parameter trains.

    Attributes:
        name: Registry name.
    """

    name: str = "full"


@dataclass
class FrozenConfig:
    """Frozen base: only ``modules_to_save`` train (default: the classification head).

    Attributes:
        name: Registry name.
        modules_to_save: Modules that train; ``None`` means the task head.
    """

    name: str = "frozen"
    modules_to_save: Union[list[str], None] = field(default=None)


def apply_full(model: nn.Module, config: FullConfig, adapter_name: str = "default") -> None:
    """Make every parameter trainable. ``adapter_name`` is ignored (there is no adapter)."""
    for p in model.parameters():
        p.requires_grad_(True)


def apply_frozen(model: nn.Module, config: FrozenConfig, adapter_name: str = "default") -> None:
    """Freeze the model except the task head (or ``config.modules_to_save``)."""
    train_only(model, config, adapter_name)


registry.register("method", "full", FullConfig, apply_full,
                  summary="full fine-tuning (every weight trains)", trains="full")
registry.register("method", "frozen", FrozenConfig, apply_frozen,
                  summary="frozen base, only the task head trains (linear probe)")
