"""LoRA (Hu et al. 2021; rsLoRA, Kalajdzievski 2023; DoRA, Liu et al. 2024): config, layer, the
PEFT file format, and the registrations."""
from __future__ import annotations

from functools import partial

from rankwise import registry
from rankwise.adapters.common.build import rebuild_at_paths
from rankwise.adapters.lora.apply import apply_lora, pattern_value
from rankwise.adapters.lora.config import LoraConfig
from rankwise.adapters.lora.layer import LoraLayer
from rankwise.configs import KEY_HINTS

__all__ = ["LoraConfig", "LoraLayer", "apply_lora", "pattern_value", "export_peft", "load_peft"]


def export_peft(*args, **kwargs):
    """See :func:`rankwise.adapters.lora.peft.export_peft` (imports safetensors when called)."""
    from rankwise.adapters.lora.peft import export_peft as _export
    return _export(*args, **kwargs)


def load_peft(*args, **kwargs):
    """See :func:`rankwise.adapters.lora.peft.load_peft` (imports safetensors when called)."""
    from rankwise.adapters.lora.peft import load_peft as _load
    return _load(*args, **kwargs)


def loaded_lora_config(*args, **kwargs):
    """See :func:`rankwise.adapters.lora.peft.loaded_lora_config`."""
    from rankwise.adapters.lora.peft import loaded_lora_config as _config
    return _config(*args, **kwargs)


# rebuild: the saved {path: {"r", "alpha", "use_rslora"[, "use_dora"]}} (LoraLayer.describe)
# there, no init computed (restore: the file holds the factors and any frozen A0, B0)
# needs_batches: eva and corda read calibration batches (the others never touch the lazy iterator)
registry.register("method", "lora", LoraConfig, apply_lora, needs_batches=True,
                  rebuild=rebuild_at_paths(partial(apply_lora, restore=True), structure=True),
                  factorized=True,
                  summary="LoRA / rsLoRA / DoRA: W x + s B A x (Hu et al. 2021; use_dora: Liu et al. 2024)")
KEY_HINTS["method.use_dora"] = ("use_dora (DoRA) is an option of LoRA only; set method.name: lora "
                                 "with use_dora: true, or remove use_dora")
registry.register("exporter", "peft", dict, export_peft, loader=load_peft, loaded_config=loaded_lora_config,
                  summary="HF PEFT adapter (adapter_config.json + adapter_model.safetensors)")
