"""The ``AdapterModule`` protocol: how a layer names and manages its own adapter weights.

Freezing, counting, saving, merging and switching all go through this protocol, never through
a parameter-name prefix (HF PEFT's prefix matching once misclassified base modules).
"""
from __future__ import annotations

from typing import Iterator, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class AdapterModule(Protocol):
    """A module that wraps ``base_layer`` and adds one or more named adapters.

    Attributes:
        base_layer: The wrapped original module (its weights are the frozen base).
    """

    base_layer: nn.Module

    def adapter_names(self) -> list[str]:
        """Return the names of the adapters this layer holds."""
        ...

    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """Return adapter ``name``'s parameters by a key relative to this layer.

        Keys are stable file keys (e.g. ``"lora_A.weight"``); values are the live parameters.
        """
        ...

    def set_active(self, names: list[str]) -> None:
        """Make ``names`` the adapters used in ``forward`` (an empty list disables all)."""
        ...

    def active_names(self) -> list[str]:
        """Return the adapters currently used in ``forward``."""
        ...

    def merge(self, name: str) -> None:
        """Fold adapter ``name`` into ``base_layer``'s weight (exact; reversible by unmerge)."""
        ...

    def unmerge(self) -> None:
        """Undo every merge, restoring the base weight."""
        ...

    def delete(self, name: str) -> None:
        """Remove adapter ``name`` from this layer."""
        ...


def adapter_modules(model: nn.Module) -> Iterator[tuple[str, AdapterModule]]:
    """Yield ``(path, module)`` for every adapter module in ``model`` (outermost first).

    Args:
        model: Any module.

    Yields:
        The dotted path of each adapter module and the module.
    """
    for path, module in model.named_modules():
        if isinstance(module, AdapterModule) and hasattr(module, "base_layer"):
            yield path, module


def base_weight(module: nn.Module) -> torch.Tensor:
    """Return the weight of a (possibly wrapped) layer."""
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module.weight
