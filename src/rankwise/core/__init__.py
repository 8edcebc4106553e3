"""Method-agnostic core: the adapter protocol, injection, adapter state, save/load, formats."""
from rankwise.core.protocol import AdapterModule, adapter_modules
from rankwise.core.inject import find_targets, inject, is_linear_like
from rankwise.core.ops import (
    adapter_state_dict,
    count_parameters,
    delete_adapter,
    disable_adapters,
    load_adapter_state_dict,
    mark_trainable,
    merge_adapters,
    merge_and_unload,
    set_adapter,
    unmerge_adapters,
)

__all__ = [
    "AdapterModule", "adapter_modules", "find_targets", "inject", "is_linear_like",
    "adapter_state_dict", "count_parameters", "delete_adapter", "disable_adapters",
    "load_adapter_state_dict", "mark_trainable", "merge_adapters", "merge_and_unload",
    "set_adapter", "unmerge_adapters",
]
