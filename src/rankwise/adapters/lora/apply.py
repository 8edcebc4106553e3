"""Putting LoRA layers on a model (:func:`apply_lora`) and PEFT's per-path pattern rule
(:func:`pattern_value`): the package's ``__init__`` registers them; the PEFT reader imports them
from here (not from the package, which imports the reader back)."""
from __future__ import annotations

import re
from typing import Iterable

from torch import nn

from rankwise import configs
from rankwise.adapters.common.build import adapt, parameter_targets, target_paths
from rankwise.adapters.common.experts import ExpertLoraLayer
from rankwise.adapters.common.factors import LORA_INITS
from rankwise.adapters.lora.calibrate import input_statistics
from rankwise.adapters.lora.config import LoraConfig
from rankwise.adapters.lora.initialise import eva_structure, initialise, loftq_layers
from rankwise.adapters.lora.inits import DATA_INITS, RESIDUAL_INITS, init_kind
from rankwise.adapters.lora.layer import LoraLayer
from rankwise.core import weights as layer_weights
from rankwise.errors import RankwiseError


def pattern_value(path: str, pattern: dict, default):
    """PEFT's rule: the first key with ``re.match(rf"(.*\\.)?({key})$", path)`` wins."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


def _layer_settings(paths: list[str], config: LoraConfig,
                    structure: dict[str, dict]) -> dict[str, tuple]:
    """``{path: (r, alpha, use_rslora, use_dora)}``: the saved structure, else patterns, else config."""
    settings = {}
    for p in paths:
        s = structure.get(p, {})
        settings[p] = (s.get("r", pattern_value(p, config.rank_pattern, config.r)),
                       s.get("alpha", pattern_value(p, config.alpha_pattern, config.alpha)),
                       s.get("use_rslora", config.use_rslora), s.get("use_dora", config.use_dora))
    return settings


def _calibrate(model: nn.Module, config: LoraConfig, paths: list[str], settings: dict[str, tuple],
               batches: Iterable[dict] | None, kind: str):
    """Input statistics of a data-driven init; EVA also redistributes the ranks.

    Returns ``(settings, stats, eva_vectors)``."""
    shapes = {p: layer_weights.shape(model.get_submodule(p)) for p in paths}  # (out, in)
    stats = input_statistics(model, paths, {p: shapes[p][1] for p in paths}, batches,
                             config.init)
    eva_vectors = None
    if kind == "eva":
        eva, eva_vectors = eva_structure(stats, {p: v[:3] for p, v in settings.items()},
                                         config.eva_rho, {p: min(shapes[p]) for p in paths})
        settings = {p: (v["r"], v["alpha"], v["use_rslora"], settings[p][3])
                    for p, v in eva.items()}
    return settings, stats, eva_vectors


def _expert_targets(model: nn.Module, config: LoraConfig, structure: dict[str, dict],
                    adapter_name: str):
    """Fused 3-D expert parameters to adapt, and the wrapper that adds their pairs.

    Returns ``({module path: [parameter names of rank > 0]}, wrap_params)``."""
    # patterns match the parameter's full name, as in PEFT
    params = parameter_targets(model, config)
    expert_settings = {}
    for path, names in params.items():
        saved = structure.get(path, {}).get("parameters", {})
        for n in names:
            key, s = f"{path}.{n}", saved.get(n, {})
            expert_settings[key] = (s.get("r", pattern_value(key, config.rank_pattern, config.r)),
                                    s.get("alpha", pattern_value(key, config.alpha_pattern, config.alpha)),
                                    s.get("use_rslora", config.use_rslora))
    params = {p: kept for p, names in params.items()
              if (kept := [n for n in names if expert_settings[f"{p}.{n}"][0] > 0])}

    def wrap_params(path: str, module: nn.Module, names: list[str]) -> nn.Module:
        layer = module if isinstance(module, ExpertLoraLayer) else ExpertLoraLayer(module)
        for n in names:
            r, alpha, rslora = expert_settings[f"{path}.{n}"]
            layer.add(adapter_name, n, r, alpha, rslora, config.init)
        return layer
    return params, wrap_params


def apply_lora(model: nn.Module, config: LoraConfig, adapter_name: str = "default",
               structure: dict[str, dict] | None = None, batches: Iterable[dict] | None = None,
               restore: bool = False, **_calibration) -> dict[str, LoraLayer]:
    """Inject LoRA adapter ``adapter_name`` into ``model`` and make only it trainable.

    Args:
        model: Any module with linear layers (bitsandbytes 4-bit/8-bit linears included: the
            factors are float32 beside the quantized base).
        config: The LoRA settings; ``config.init`` picks the initialisation
            (docs/lora-inits.md).
        adapter_name: Name of this adapter (several can coexist; see ``core.set_adapter``).
        structure: Optional exact per-path settings ``{path: {"r": .., "alpha": ..,
            "use_rslora": .., "use_dora": ..}}`` (adaptive-rank methods, loading); each key
            overrides the config and patterns for that path; ``r = 0`` skips the layer. A
            module with adapted expert parameters has ``{path: {"parameters": {name: {"r",
            ...}}}}``.
        batches: Calibration batches (``model(**batch)``) for ``eva`` and ``corda``; the
            registry hands them over (``rankwise train``: ``train.calibration_batches``).
        restore: Rebuilding a saved adapter: allocate the layers (and the frozen ``A0, B0`` of
            a residual init) without computing any init; the file's tensors follow.

    Returns:
        ``{path: LoraLayer}`` for the adapted layers (and ``{path: ExpertLoraLayer}`` for the
        modules whose ``config.target_parameters`` are adapted).

    Raises:
        RankwiseError: On targets or target parameters matching nothing (or a parameter that
            is not 3-D), ranks outside [1, min(in, out)], an unknown init, ``eva``/``corda``
            without batches, ``loftq`` without a 4-bit base.
    """
    problems = [p for p in configs.problems_of(config)
                if p.split(":")[0] in ("init", "loftq_iter", "eva_rho", "corda_mode")]
    if problems:
        raise RankwiseError(f"method.{problems[0]}")
    paths = target_paths(model, config)
    settings = _layer_settings(paths, config, structure or {})
    kind = init_kind(config.init)
    stats = eva_vectors = None
    if kind in DATA_INITS and not restore:
        settings, stats, eva_vectors = _calibrate(model, config, paths, settings, batches, kind)
    paths = [p for p in paths if settings[p][0] > 0]
    random_init = config.init if config.init in LORA_INITS else "kaiming"  # then overwritten

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, LoraLayer) else LoraLayer(module)
        r, alpha, rslora, use_dora = settings[path]
        layer.add(adapter_name, r, alpha, config.dropout, rslora, random_init, use_dora)
        if restore and kind in RESIDUAL_INITS:  # shapes only: the file fills A0, B0
            layer.set_initial(adapter_name, layer.lora_A[adapter_name].weight,
                              layer.lora_B[adapter_name].weight, residual=True)
        return layer

    params, wrap_params = _expert_targets(model, config, structure or {}, adapter_name)
    layers = adapt(model, config, adapter_name, wrap, paths, wrap_params, params)
    lora_layers = {p: m for p, m in layers.items() if isinstance(m, LoraLayer)}
    if not restore:
        initialise(model, lora_layers, config, adapter_name, stats, eva_vectors)
    elif kind == "loftq" and config.loftq_iter > 1:  # the same re-quantized base, from W
        loftq_layers(model, lora_layers, adapter_name, config.loftq_iter, set_factors=False)
    return layers
