"""rankwise's own adapter format: ``adapter.safetensors`` + ``rankwise_adapter.json``.

The JSON holds the method config, the *structure* needed to rebuild the adapter layers
(for every LoRA-shaped result: per-layer rank/alpha), and a fingerprint of the base model's
parameter shapes. Loading onto a different base model fails with a message naming both.
Nothing is ever unpickled.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from rankwise.core import atomic
from rankwise.core.ops import adapter_state_dict, load_adapter_state_dict, modules_to_save
from rankwise.core.protocol import adapter_modules
from rankwise.errors import RankwiseError

WEIGHTS = "adapter.safetensors"
CONFIG = "rankwise_adapter.json"
FORMAT_VERSION = 1


def base_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Return ``{name: shape}`` of the base model's parameters (adapter weights excluded)."""
    adapter_ids = {id(p) for _, m in adapter_modules(model) for n in m.adapter_names()
                   for p in m.adapter_params(n).values()}
    return {k.replace(".base_layer", ""): list(p.shape)
            for k, p in model.named_parameters() if id(p) not in adapter_ids}


def fingerprint(model: nn.Module) -> str:
    """Return a short hash of the base model's parameter names and shapes."""
    text = json.dumps(sorted(base_shapes(model).items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_id(model: nn.Module) -> str:
    """Return a human name for a model: its ``name_or_path`` or its class."""
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "_name_or_path", "") or type(model).__name__)


def lora_structure(model: nn.Module, name: str = "default") -> dict[str, dict[str, Any]] | None:
    """Return ``{path: {"r", "alpha", "use_rslora"}}`` for LoRA-shaped layers, or None if none."""
    from rankwise.adapters.lora.layer import LoraLayer  # core stays import-light
    out = {}
    for path, mod in adapter_modules(model):
        if isinstance(mod, LoraLayer) and name in mod.adapter_names():
            out[path] = {"r": mod.ranks[name], "alpha": mod.alphas[name],
                         "use_rslora": mod.rslora.get(name, False)}
    return out or None


def save_adapter(model: nn.Module, out_dir: str | Path, method_config: Any,
                 name: str = "default", extra: dict | None = None) -> Path:
    """Save adapter ``name`` atomically in rankwise's format.

    Args:
        model: The adapted model.
        out_dir: Target folder (replaced as a whole only when writing succeeded).
        method_config: The method's config dataclass (or dict) used to train it.
        name: The adapter to save.
        extra: Extra JSON-serialisable metadata (e.g. GoRA's importances).

    Returns:
        The folder written.
    """
    cfg = asdict(method_config) if is_dataclass(method_config) else dict(method_config)
    tensors = {k: v.detach().cpu().contiguous() for k, v in adapter_state_dict(model, name).items()}
    meta = {
        "format": "rankwise-adapter", "version": FORMAT_VERSION, "method": cfg,
        "structure": lora_structure(model, name), "modules_to_save": modules_to_save(model),
        "base_model": model_id(model), "fingerprint": fingerprint(model), "extra": extra or {},
    }
    out_dir = Path(out_dir)
    with atomic.folder(out_dir) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        atomic.write_json(tmp / CONFIG, meta)
    return out_dir


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a rankwise adapter folder without touching any model.

    Returns:
        ``(meta, tensors)``.

    Raises:
        RankwiseError: If the folder, JSON or safetensors file is missing or corrupt.
    """
    path = Path(path)
    if not (path / CONFIG).is_file():
        hint = " (this is a PEFT adapter: use rankwise.core.peft_format.load_peft)" \
            if (path / "adapter_config.json").is_file() else ""
        raise RankwiseError(f"{path} is not a rankwise adapter folder: {CONFIG} is missing{hint}")
    try:
        meta = json.loads((path / CONFIG).read_text())
        if meta.get("format") != "rankwise-adapter":
            raise ValueError("wrong format tag")
    except (ValueError, OSError) as err:
        raise RankwiseError(f"{path / CONFIG} is corrupt ({err}); re-export the adapter") from None
    try:
        tensors = load_file(str(path / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as err:
        raise RankwiseError(f"{path / WEIGHTS} is missing or corrupt ({err}); "
                            "re-export the adapter from its run folder") from None
    return meta, tensors


def load_adapter(model: nn.Module, path: str | Path, name: str = "default") -> dict:
    """Inject and load a saved adapter into ``model`` (in place).

    Args:
        model: The same base model the adapter was trained on.
        path: A folder written by :func:`save_adapter`.
        name: The adapter name to load it as.

    Returns:
        The saved metadata.

    Raises:
        RankwiseError: If the files are corrupt or the base model differs (names both).
    """
    from rankwise import registry
    from rankwise.configs import from_dict

    meta, tensors = read_adapter(path)
    have = fingerprint(model)
    if meta.get("fingerprint") != have:
        raise RankwiseError(
            f"adapter in {path} was trained on base model {meta.get('base_model')!r} "
            f"(fingerprint {meta.get('fingerprint')}), but this model is {model_id(model)!r} "
            f"(fingerprint {have}); load it onto the base model it was trained on")
    structure = meta.get("structure")
    if structure:
        from rankwise.adapters.lora import LoraConfig, apply_lora
        method = meta.get("method", {})
        cfg = LoraConfig(targets=list(structure), modules_to_save=meta.get("modules_to_save", []),
                         dropout=float(method.get("dropout", 0.0)))
        apply_lora(model, cfg, name, structure=structure)
    else:
        method = dict(meta.get("method", {}))
        entry = registry.get("method", method.get("name", "?"))
        entry.builder(model, from_dict(entry.config_cls, method, "method"), name)
    load_adapter_state_dict(model, tensors, name)
    return meta
