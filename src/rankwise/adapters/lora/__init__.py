"""LoRA (Hu et al. 2021; rsLoRA, Kalajdzievski 2023; DoRA, Liu et al. 2024): config, layer, the
PEFT file format, and the registrations."""
from __future__ import annotations

import re

from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import adapt, parameter_targets, rebuild_at_paths, target_paths
from rankwise.adapters.common.experts import ExpertLoraLayer
from rankwise.adapters.lora.config import LoraConfig
from rankwise.adapters.lora.layer import LoraLayer
from rankwise.configs import KEY_HINTS

__all__ = ["LoraConfig", "LoraLayer", "apply_lora", "pattern_value", "export_peft", "load_peft"]


def pattern_value(path: str, pattern: dict, default):
    """PEFT's rule: the first key with ``re.match(rf"(.*\\.)?({key})$", path)`` wins."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


def apply_lora(model: nn.Module, config: LoraConfig, adapter_name: str = "default",
               structure: dict[str, dict] | None = None) -> dict[str, LoraLayer]:
    """Inject LoRA adapter ``adapter_name`` into ``model`` and make only it trainable.

    Args:
        model: Any module with linear layers (bitsandbytes 4-bit/8-bit linears included: the
            factors are float32 beside the quantized base).
        config: The LoRA settings.
        adapter_name: Name of this adapter (several can coexist; see ``core.set_adapter``).
        structure: Optional exact per-path settings ``{path: {"r": .., "alpha": ..,
            "use_rslora": .., "use_dora": ..}}`` (adaptive-rank methods, loading); each key
            overrides the config and patterns for that path; ``r = 0`` skips the layer. A
            module with adapted expert parameters has ``{path: {"parameters": {name: {"r",
            ...}}}}``.

    Returns:
        ``{path: LoraLayer}`` for the adapted layers (and ``{path: ExpertLoraLayer}`` for the
        modules whose ``config.target_parameters`` are adapted).

    Raises:
        RankwiseError: On targets or target parameters matching nothing (or a parameter that
            is not 3-D) and ranks outside [1, min(in, out)].
    """
    paths = target_paths(model, config)
    structure = structure or {}
    settings = {}
    for p in paths:
        s = structure.get(p, {})
        settings[p] = (s.get("r", pattern_value(p, config.rank_pattern, config.r)),
                       s.get("alpha", pattern_value(p, config.alpha_pattern, config.alpha)),
                       s.get("use_rslora", config.use_rslora), s.get("use_dora", config.use_dora))
    paths = [p for p in paths if settings[p][0] > 0]

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, LoraLayer) else LoraLayer(module)
        r, alpha, rslora, use_dora = settings[path]
        layer.add(adapter_name, r, alpha, config.dropout, rslora, config.init, use_dora)
        return layer

    # fused 3-D expert parameters: patterns match the parameter's full name, as in PEFT
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

    return adapt(model, config, adapter_name, wrap, paths, wrap_params, params)


def export_peft(*args, **kwargs):
    """See :func:`rankwise.adapters.lora.peft.export_peft` (imports safetensors when called)."""
    from rankwise.adapters.lora.peft import export_peft as _export
    return _export(*args, **kwargs)


def load_peft(*args, **kwargs):
    """See :func:`rankwise.adapters.lora.peft.load_peft` (imports safetensors when called)."""
    from rankwise.adapters.lora.peft import load_peft as _load
    return _load(*args, **kwargs)


# rebuild: the saved {path: {"r", "alpha", "use_rslora"[, "use_dora"]}} (LoraLayer.describe) there
registry.register("method", "lora", LoraConfig, apply_lora,
                  rebuild=rebuild_at_paths(apply_lora, structure=True), factorized=True,
                  summary="LoRA / rsLoRA / DoRA: W x + s B A x (Hu et al. 2021; use_dora: Liu et al. 2024)")
KEY_HINTS["method.use_dora"] = ("use_dora (DoRA) is an option of LoRA only; set method.name: lora "
                                 "with use_dora: true, or remove use_dora")
registry.register("exporter", "peft", dict, export_peft, loader=load_peft,
                  summary="HF PEFT adapter (adapter_config.json + adapter_model.safetensors)")
