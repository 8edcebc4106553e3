"""What every method's builder shares: the builder tail (:func:`adapt`; :func:`train_only` for
methods that wrap something else than target layers) and rebuilding at saved paths.

A method's builder is its own ``wrap(path, module)`` (wrap a base layer, or add one more adapter
to a layer already wrapped) handed to :func:`adapt`; its registry ``rebuild`` is
:func:`rebuild_at_paths` of that builder.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import nn

from rankwise.core.inject import default_heads, find_parameter_targets, find_targets, inject
from rankwise.core.ops import mark_trainable, set_modules_to_save
from rankwise.core.quant import keep_training_layout


def target_paths(model: nn.Module, config: Any) -> list[str]:
    """The layers ``config.targets`` selects, minus ``config.exclude``.

    Args:
        model: The model to adapt.
        config: A :class:`rankwise.adapters.common.config.TargetedConfig`.

    Returns:
        Module paths in model order; none when ``targets`` is ``[]`` and the config adapts
        fused expert parameters (``target_parameters``) instead.

    Raises:
        RankwiseError: If the targets match nothing or a match is not a linear layer.
    """
    if config.targets == [] and getattr(config, "target_parameters", None):
        return []
    return find_targets(model, config.targets, config.exclude, "method.targets")


def parameter_targets(model: nn.Module, config: Any) -> dict[str, list[str]]:
    """The fused 3-D expert parameters ``config.target_parameters`` selects (none if unset).

    Args:
        model: The model to adapt.
        config: A :class:`rankwise.adapters.common.config.LoraPairConfig`.

    Returns:
        ``{module path: [parameter names]}`` in model order.

    Raises:
        RankwiseError: If the names match nothing or a match is not 3-D.
    """
    names = getattr(config, "target_parameters", None) or []
    if not names:
        return {}
    return find_parameter_targets(model, names, config.exclude, "method.target_parameters")


def adapt(model: nn.Module, config: Any, adapter_name: str,
          wrap: Callable[[str, nn.Module], nn.Module],
          paths: list[str] | None = None,
          param_wrap: Callable[[str, nn.Module, list[str]], nn.Module] | None = None,
          params: dict[str, list[str]] | None = None) -> dict[str, nn.Module]:
    """The builder tail: keep 4-bit bases in their training layout, put ``wrap(path, module)``
    at every target (and ``param_wrap(path, module, parameter names)`` at every module holding
    targeted expert parameters), and make only adapter ``adapter_name`` (and the modules to
    save) train.

    Args:
        model: The model to adapt (in place).
        config: The method config, a :class:`rankwise.adapters.common.config.TargetedConfig`
            (``targets``, ``exclude``, ``modules_to_save``).
        adapter_name: Name of the adapter ``wrap`` adds.
        wrap: ``wrap(path, module) -> module`` wrapping one target layer (or adding the adapter
            to a layer already wrapped).
        paths: The target paths when the builder needed them first; ``None``:
            :func:`target_paths`.
        param_wrap: ``param_wrap(path, module, names) -> module`` wrapping one module whose
            3-D parameters ``names`` are targeted (e.g. an
            :class:`rankwise.adapters.common.experts.ExpertLoraLayer`); ``None``: the method
            does not adapt parameters.
        params: ``{module path: parameter names}`` when the builder needed them first;
            ``None``: :func:`parameter_targets`.

    Returns:
        ``{path: adapter layer}``.

    Raises:
        RankwiseError: If the targets match nothing, or as ``wrap`` does.
    """
    if paths is None:
        paths = target_paths(model, config)
    if param_wrap is not None and params is None:
        params = parameter_targets(model, config)
    keep_training_layout(model)  # 4-bit bases: no CPU inference repacking while adapted
    layers = inject(model, paths, wrap)
    if param_wrap is not None and params:
        layers.update(inject(model, list(params), lambda p, m: param_wrap(p, m, params[p])))
    train_only(model, config, adapter_name)
    return layers


def train_only(model: nn.Module, config: Any, adapter_name: str) -> None:
    """Make only adapter ``adapter_name`` and the modules to save trainable.

    Args:
        model: The adapted model.
        config: A method config with ``modules_to_save`` (``None``: the task heads,
            ``classifier`` / ``score``, of a classification model).
        adapter_name: The adapter that trains.
    """
    heads = default_heads(model) if config.modules_to_save is None else config.modules_to_save
    set_modules_to_save(model, heads)
    mark_trainable(model, adapter_name)


def rebuild_at_paths(builder: Callable[..., Any], structure: bool = False) -> Callable[..., Any]:
    """A registry ``rebuild`` that re-runs ``builder`` on exactly the saved layer paths.

    The saved structure (``{path: describe(name)}``) names the layers that were adapted; the
    method config (whose ``targets`` may be a keyword such as ``all-linear``) is re-targeted to
    those paths, so loading reproduces the trained layout even if target resolution changes.

    Args:
        builder: ``builder(model, config, adapter_name)`` of a
            :class:`rankwise.adapters.common.config.TargetedConfig` (its ``exclude`` is emptied).
        structure: Also pass the saved structure, ``builder(..., structure=layers)`` (``None``
            when nothing was saved), for builders whose layers differ per path (ranks).

    Returns:
        ``rebuild(model, config, adapter_name, layers)``.
    """
    def rebuild(model: nn.Module, config: Any, adapter_name: str, layers: dict[str, dict]) -> Any:
        if layers:
            # a layer that describes "parameters" adapted fused expert parameters of its module
            modules = [p for p, d in layers.items() if "parameters" not in d]
            params = [f"{p}.{n}" for p, d in layers.items() if "parameters" in d
                      for n in d["parameters"]]
            extra = {"target_parameters": params} if hasattr(config, "target_parameters") else {}
            config = dataclasses.replace(config, targets=modules, exclude=[], **extra)
        if structure:
            return builder(model, config, adapter_name, structure=layers or None)
        return builder(model, config, adapter_name)

    return rebuild
