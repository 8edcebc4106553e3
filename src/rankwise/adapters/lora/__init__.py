"""LoRA (ROADMAP A1): config, layer and the one registration."""
from __future__ import annotations

import re

from torch import nn

from rankwise import registry
from rankwise.adapters.lora.config import LoraConfig
from rankwise.adapters.lora.layer import LORA_INITS, LoraLayer, lora_scale
from rankwise.core.inject import find_targets, inject
from rankwise.core.ops import mark_trainable, set_modules_to_save

__all__ = ["LoraConfig", "LoraLayer", "LORA_INITS", "apply_lora", "lora_scale", "pattern_value",
           "default_heads"]

HEAD_CHILDREN = ("classifier", "score", "qa_outputs")


def pattern_value(path: str, pattern: dict, default):
    """PEFT's rule: the first key with ``re.match(rf"(.*\\.)?({key})$", path)`` wins."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


def default_heads(model: nn.Module) -> list[str]:
    """Return the task-head children trained with any adapter (PEFT does the same for SEQ_CLS)."""
    return [n for n, _ in model.named_children() if n in HEAD_CHILDREN]


def apply_lora(model: nn.Module, config: LoraConfig, adapter_name: str = "default",
               structure: dict[str, dict] | None = None) -> dict[str, LoraLayer]:
    """Inject LoRA adapter ``adapter_name`` into ``model`` and make only it trainable.

    Args:
        model: Any module with linear layers.
        config: The LoRA settings.
        adapter_name: Name of this adapter (several can coexist; see ``core.set_adapter``).
        structure: Optional exact per-path settings ``{path: {"r": .., "alpha": ..,
            "use_rslora": ..}}`` (adaptive-rank methods, loading); each key overrides the
            config and patterns for that path; ``r = 0`` skips the layer.

    Returns:
        ``{path: LoraLayer}`` for the adapted layers.

    Raises:
        RankwiseError: On targets matching nothing or ranks outside [1, min(in, out)].
    """
    paths = find_targets(model, config.targets, config.exclude)
    structure = structure or {}
    settings = {}
    for p in paths:
        s = structure.get(p, {})
        settings[p] = (s.get("r", pattern_value(p, config.rank_pattern, config.r)),
                       s.get("alpha", pattern_value(p, config.alpha_pattern, config.alpha)),
                       s.get("use_rslora", config.use_rslora))
    paths = [p for p in paths if settings[p][0] > 0]

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, LoraLayer) else LoraLayer(module)
        r, alpha, rslora = settings[path]
        layer.add(adapter_name, r, alpha, config.dropout, rslora, config.init)
        return layer

    layers = inject(model, paths, wrap)
    heads = default_heads(model) if config.modules_to_save is None else config.modules_to_save
    set_modules_to_save(model, heads)
    mark_trainable(model, adapter_name)
    return layers


registry.register("method", "lora", LoraConfig, apply_lora,
                  summary="LoRA / rsLoRA: W x + s B A x (Hu et al. 2021)")
