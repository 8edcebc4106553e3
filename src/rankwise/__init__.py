"""rankwise: low-rank and parameter-efficient training in one API.

Quick start::

    import rankwise
    model = ...  # any torch / transformers model
    rankwise.apply(model, "lora", r=8, targets=["query", "value"])
    ...train...
    rankwise.save_adapter(model, "my-adapter", rankwise.method_config("lora", r=8))

Only torch is needed to ``import rankwise``; heavier pieces load where used.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.core import (
    adapter_state_dict, count_parameters, disable_adapters, merge_adapters, merge_and_unload,
    set_adapter, unmerge_adapters,
)
from rankwise.core.io import load_adapter, save_adapter
from rankwise.core.merged import export_merged
from rankwise.core.peft_format import export_peft, load_peft
from rankwise.core.summary import print_summary
from rankwise.errors import RankwiseError

__version__ = "0.1.0"


def method_config(name: str, **overrides: Any):
    """Return the config dataclass of method ``name`` with ``overrides`` applied.

    Raises:
        RankwiseError: Unknown method, unknown keys or bad values.
    """
    entry = registry.get("method", name)
    return from_dict(entry.config_cls, {**overrides, "name": name}, "method")


def apply(model: nn.Module, method: str | Any = "lora", adapter_name: str = "default",
          **overrides: Any) -> Any:
    """Adapt ``model`` in place with a registered method and return the config used.

    Args:
        model: Any ``nn.Module``.
        method: A method name (``"lora"``) or a config dataclass instance.
        adapter_name: Name of the adapter (several may coexist).
        **overrides: Config fields when ``method`` is a name.

    Returns:
        The method config.
    """
    cfg = method_config(method, **overrides) if isinstance(method, str) else method
    registry.get("method", cfg.name).builder(model, cfg, adapter_name)
    return cfg


__all__ = [
    "RankwiseError", "apply", "method_config", "registry", "save_adapter", "load_adapter",
    "export_peft", "load_peft", "export_merged", "print_summary",
    "adapter_state_dict", "count_parameters", "disable_adapters", "merge_adapters",
    "unmerge_adapters", "merge_and_unload", "set_adapter", "__version__",
]
