"""LoRA (Hu et al. 2021; rsLoRA, Kalajdzievski 2023): config, layer, the PEFT file format, and
the registrations."""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable

from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import adapt, target_paths
from rankwise.adapters.common.factors import LORA_INITS
from rankwise.adapters.lora.calibrate import input_statistics
from rankwise.adapters.lora.config import LoraConfig
from rankwise.adapters.lora.initialise import eva_structure, initialise, loftq_layers
from rankwise.adapters.lora.inits import DATA_INITS, RESIDUAL_INITS, init_kind
from rankwise.adapters.lora.layer import LoraLayer
from rankwise.core import weights as layer_weights
from rankwise.errors import RankwiseError

__all__ = ["LoraConfig", "LoraLayer", "apply_lora", "pattern_value", "export_peft", "load_peft"]


def pattern_value(path: str, pattern: dict, default):
    """PEFT's rule: the first key with ``re.match(rf"(.*\\.)?({key})$", path)`` wins."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


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
            "use_rslora": ..}}`` (adaptive-rank methods, loading); each key overrides the
            config and patterns for that path; ``r = 0`` skips the layer.
        batches: Calibration batches (``model(**batch)``) for ``eva`` and ``corda``; the
            registry hands them over (``rankwise train``: ``train.calibration_batches``).
        restore: Rebuilding a saved adapter: allocate the layers (and the frozen ``A0, B0`` of
            a residual init) without computing any init; the file's tensors follow.

    Returns:
        ``{path: LoraLayer}`` for the adapted layers.

    Raises:
        RankwiseError: On targets matching nothing, ranks outside [1, min(in, out)], an
            unknown init, ``eva``/``corda`` without batches, ``loftq`` without a 4-bit base.
    """
    problems = [p for p in config.problems()
                if p.split(":")[0] in ("init", "loftq_iter", "eva_rho", "corda_mode")]
    if problems:
        raise RankwiseError(f"method.{problems[0]}")
    paths = target_paths(model, config)
    structure = structure or {}
    settings = {}
    for p in paths:
        s = structure.get(p, {})
        settings[p] = (s.get("r", pattern_value(p, config.rank_pattern, config.r)),
                       s.get("alpha", pattern_value(p, config.alpha_pattern, config.alpha)),
                       s.get("use_rslora", config.use_rslora))
    kind = init_kind(config.init)
    stats = eva_vectors = None
    if kind in DATA_INITS and not restore:
        shapes = {p: layer_weights.shape(model.get_submodule(p)) for p in paths}  # (out, in)
        stats = input_statistics(model, paths, {p: shapes[p][1] for p in paths}, batches,
                                 config.init)
        if kind == "eva":
            eva, eva_vectors = eva_structure(stats, settings, config.eva_rho,
                                             {p: min(shapes[p]) for p in paths})
            settings = {p: (v["r"], v["alpha"], v["use_rslora"]) for p, v in eva.items()}
    paths = [p for p in paths if settings[p][0] > 0]
    random_init = config.init if config.init in LORA_INITS else "kaiming"  # then overwritten

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, LoraLayer) else LoraLayer(module)
        r, alpha, rslora = settings[path]
        layer.add(adapter_name, r, alpha, config.dropout, rslora, random_init)
        if restore and kind in RESIDUAL_INITS:  # shapes only: the file fills A0, B0
            layer.set_initial(adapter_name, layer.lora_A[adapter_name].weight,
                              layer.lora_B[adapter_name].weight, residual=True)
        return layer

    layers = adapt(model, config, adapter_name, wrap, paths)
    if not restore:
        initialise(model, layers, config, adapter_name, stats, eva_vectors)
    elif kind == "loftq" and config.loftq_iter > 1:  # the same re-quantized base, from W
        loftq_layers(model, layers, adapter_name, config.loftq_iter, set_factors=False)
    return layers


def rebuild_lora(model: nn.Module, config: LoraConfig, adapter_name: str,
                 layers: dict[str, dict]) -> dict[str, LoraLayer]:
    """Registry ``rebuild``: the saved layers, ranks and residual pairs, no init computed."""
    if layers:
        config = dataclasses.replace(config, targets=list(layers), exclude=[])
    return apply_lora(model, config, adapter_name, structure=layers or None, restore=True)


def export_peft(*args, **kwargs):
    """See :func:`rankwise.adapters.lora.peft.export_peft` (imports safetensors when called)."""
    from rankwise.adapters.lora.peft import export_peft as _export
    return _export(*args, **kwargs)


def load_peft(*args, **kwargs):
    """See :func:`rankwise.adapters.lora.peft.load_peft` (imports safetensors when called)."""
    from rankwise.adapters.lora.peft import load_peft as _load
    return _load(*args, **kwargs)


# rebuild: the saved {path: {"r", "alpha", "use_rslora"}} (LoraLayer.describe) at those paths
# needs_batches: eva and corda read calibration batches (the others never touch the lazy iterator)
registry.register("method", "lora", LoraConfig, apply_lora, needs_batches=True,
                  rebuild=rebuild_lora, factorized=True,
                  summary="LoRA / rsLoRA: W x + s B A x (Hu et al. 2021)")
registry.register("exporter", "peft", dict, export_peft, loader=load_peft,
                  summary="HF PEFT adapter (adapter_config.json + adapter_model.safetensors)")
