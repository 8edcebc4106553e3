"""Helpers shared by adapter packages that wrap target layers: rebuilding at saved paths."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import nn


def rebuild_at_paths(builder: Callable[..., Any]) -> Callable[..., Any]:
    """A registry ``rebuild`` that re-runs ``builder`` on exactly the saved layer paths.

    The saved structure (``{path: describe(name)}``) names the layers that were adapted; the
    method config (whose ``targets`` may be a keyword such as ``all-linear``) is re-targeted to
    those paths, so loading reproduces the trained layout even if target resolution changes.

    Args:
        builder: ``builder(model, config, adapter_name)`` of a config with ``targets`` and
            ``exclude`` fields.

    Returns:
        ``rebuild(model, config, adapter_name, layers)``.
    """
    def rebuild(model: nn.Module, config: Any, adapter_name: str, layers: dict[str, dict]) -> Any:
        if layers:
            config = dataclasses.replace(config, targets=list(layers), exclude=[])
        return builder(model, config, adapter_name)

    return rebuild
