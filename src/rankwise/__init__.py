"""rankwise: low-rank and parameter-efficient training in one API.

Quick start::

    import rankwise
    model = ...  # any torch / transformers model
    rankwise.apply(model, "lora", r=8, targets=["query", "value"])
    opt = rankwise.optimizer(model, "galore", lr=1e-3, rank=64)
    ...train...
    rankwise.save_adapter(model, "my-adapter", rankwise.method_config("lora", r=8))

A whole run, as ``rankwise train`` (docs/python-api.md)::

    metrics = rankwise.train({"model": {"path": "demo"}, "train": {"steps": 50}}, "runs/demo")

``import rankwise`` needs only torch: file formats (safetensors), transformers, rich and
Flower load when a function that needs them is first called.
"""
from __future__ import annotations

import importlib
from typing import Any, Iterable

from torch import nn

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.core import (
    adapter_state_dict, count_parameters, disable_adapters, merge_adapters, merge_and_unload,
    set_adapter, unmerge_adapters,
)
from rankwise.errors import RankwiseError

__version__ = "0.1.0"

# public name -> "module:attribute", imported on first use (PEP 562)
_LAZY = {
    "save_adapter": "rankwise.core.io:save_adapter",
    "load_adapter": "rankwise.core.io:load_adapter",
    "export_merged": "rankwise.core.merged:export_merged",
    "print_summary": "rankwise.core.summary:print_summary",
    "export_peft": "rankwise.adapters.lora.peft:export_peft",
    "load_peft": "rankwise.adapters.lora.peft:load_peft",
    "train": "rankwise.recipes.api:train",
    "load_config": "rankwise.recipes.api:load_config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, _, attr = _LAZY[name].partition(":")
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rankwise' has no attribute {name!r}")


def method_config(name: str, **overrides: Any):
    """Return the config dataclass of method ``name`` with ``overrides`` applied.

    Raises:
        RankwiseError: Unknown method, unknown keys or bad values.
    """
    entry = registry.get("method", name)
    return from_dict(entry.config_cls, {**overrides, "name": name}, "method")


def apply(model: nn.Module, method: str | Any = "lora", adapter_name: str = "default",
          batches: Iterable[dict] | None = None, **overrides: Any) -> Any:
    """Adapt ``model`` in place with a registered method and return the config used.

    Args:
        model: Any ``nn.Module``.
        method: A method name (``"lora"``) or a config dataclass instance.
        adapter_name: Name of the adapter (several may coexist).
        batches: Calibration batches for data-driven methods (GoRA): dicts that
            ``model(**batch)`` turns into an output with ``.loss``.
        **overrides: Config fields when ``method`` is a name.

    Returns:
        The method config.

    Raises:
        RankwiseError: Unknown method, bad settings, or a data-driven method without batches.
    """
    cfg = method_config(method, **overrides) if isinstance(method, str) else method
    registry.get("method", cfg.name).apply(model, cfg, adapter_name, batches)
    return cfg


def optimizer(model: nn.Module, name: str = "adamw", **overrides: Any):
    """Build a registered optimizer over ``model``'s trainable parameters.

    Works with any training loop, including ``transformers.Trainer(optimizers=(opt, None))``.

    Args:
        model: The (adapted) model.
        name: Registry name (``adamw``, ``galore``, ``sumo``, ``altlora``...).
        **overrides: Fields of that optimizer's config (``lr``, ``rank``...).

    Returns:
        A ``torch.optim.Optimizer``.

    Raises:
        RankwiseError: Unknown optimizer or bad settings.
    """
    entry = registry.get("optimizer", name)
    return entry.builder(model, from_dict(entry.config_cls, {**overrides, "name": name}, "optim"))


__all__ = [
    "RankwiseError", "apply", "optimizer", "method_config", "registry", "save_adapter",
    "load_adapter", "export_peft", "load_peft", "export_merged", "print_summary",
    "adapter_state_dict", "count_parameters", "disable_adapters", "merge_adapters",
    "unmerge_adapters", "merge_and_unload", "set_adapter", "train", "load_config", "__version__",
]
