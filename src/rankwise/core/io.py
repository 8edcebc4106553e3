"""rankwise's own adapter format: ``adapter.safetensors`` + ``rankwise_adapter.json``.

The JSON holds the method config, the *structure* each adapter layer describes of itself
(the protocol's ``describe``: per-layer ranks, expert counts...), a fingerprint of the base
model's parameter shapes and a sample of its embedding weights (``weight_sample``, a cheap
checksum). Loading rebuilds the layers through the method's registry entry, so this module
knows no method. Loading onto a different base model - other shapes, or the same shapes with
other weights - fails with a message naming both.
Nothing is ever unpickled.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from rankwise.core import atomic
from rankwise.core.ops import (adapter_state_dict, load_adapter_state_dict, mark_trainable,
                               modules_to_save, set_modules_to_save)
from rankwise.core.protocol import adapter_modules, describe
from rankwise.core.quant import keep_training_layout
from rankwise.core.weights import logical_shapes, sample_mismatch, weight_sample
from rankwise.errors import RankwiseError

WEIGHTS = "adapter.safetensors"
CONFIG = "rankwise_adapter.json"
FORMAT_VERSION = 1


def fingerprint(model: nn.Module) -> str:
    """Return a short hash of the base model's parameter names and logical shapes."""
    text = json.dumps(sorted(logical_shapes(model).items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_id(model: nn.Module) -> str:
    """Return a human name for a model: its ``name_or_path`` or its class."""
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "_name_or_path", "") or type(model).__name__)


def structure(model: nn.Module, name: str = "default") -> dict[str, dict[str, Any]]:
    """``{layer path: describe(name)}`` for every adapter layer holding ``name``.

    This, with the method config, is what :func:`rebuild` needs to recreate the adapter
    layers without repeating a data-driven initialisation (GoRA's rank allocation).
    """
    return {path: describe(mod, name) for path, mod in adapter_modules(model)
            if name in mod.adapter_names()}


def rebuild(model: nn.Module, method: dict | Any, name: str = "default",
            layers: dict[str, dict] | None = None, saved_modules: list[str] | None = None) -> Any:
    """Recreate adapter ``name`` on ``model`` through the registry (weights not loaded).

    Args:
        model: The base model.
        method: The method config (dataclass, or a dict with ``name``).
        name: Adapter name.
        layers: The saved :func:`structure` (``None``: build from the config alone); the
            trainable-token layers in it (:mod:`rankwise.core.tokens`, any method) are rebuilt
            after the method's own layers.
        saved_modules: The whole modules that trained with it (heads).

    Returns:
        The method config used.

    Raises:
        RankwiseError: Unknown method or bad config values.
    """
    from rankwise import registry
    from rankwise.configs import from_dict
    from rankwise.core.tokens import is_token_structure, rebuild_tokens
    data = asdict(method) if is_dataclass(method) else dict(method)
    entry = registry.get("method", str(data.get("name", "?")))
    cfg = from_dict(entry.config_cls, data, "method")
    layers = layers or {}
    tokens = {p: d for p, d in layers.items() if is_token_structure(d)}  # method-agnostic rows
    layers = {p: d for p, d in layers.items() if p not in tokens}
    if entry.rebuild is not None:
        entry.rebuild(model, cfg, name, layers)
    else:
        entry.builder(model, cfg, name)
    rebuild_tokens(model, tokens, name)
    if saved_modules is not None:
        set_modules_to_save(model, saved_modules)
        if entry.trains != "full":
            mark_trainable(model, name)
    return cfg


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
        "structure": structure(model, name), "modules_to_save": modules_to_save(model),
        "base_model": model_id(model), "fingerprint": fingerprint(model), "extra": extra or {},
        "weight_sample": weight_sample(model, modules_to_save(model)),
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
        hint = " (this is a PEFT adapter: use rankwise.load_peft)" \
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


def _check_weights(model: nn.Module, meta: dict, path: Path) -> None:
    """Refuse a base with the adapter's shapes but other weights (the saved weight sample);
    adapters written before the sample was recorded load with a warning."""
    saved = meta.get("weight_sample")
    if saved is None:
        warnings.warn(f"adapter in {path} records no weight checksum (written by an older rankwise): "
                      "only the base model's shapes were checked", UserWarning, stacklevel=3)
        return
    differs = sample_mismatch(saved, weight_sample(model, meta.get("modules_to_save", [])))
    if differs is not None:
        raise RankwiseError(
            f"adapter in {path} was trained on other weights than this model's: {differs} differs "
            f"from the base it was trained on ({meta.get('base_model')!r}), though every shape "
            "matches; load it onto the base model it was trained on")


def load_adapter(model: nn.Module, path: str | Path, name: str = "default",
                 check: bool = True) -> dict:
    """Inject and load a saved adapter into ``model`` (in place).

    Args:
        model: The same base model the adapter was trained on.
        path: A folder written by :func:`save_adapter`.
        name: The adapter name to load it as.
        check: Run one probe batch with and without the adapter and refuse an adapter whose
            non-zero weights do not change the output (:func:`rankwise.core.probe.check_effect`).

    Returns:
        The saved metadata.

    Raises:
        RankwiseError: If the files are corrupt, the base model differs (names both), or the
            loaded adapter does nothing (``check``).
    """
    meta, tensors = read_adapter(path)
    have = fingerprint(model)
    if meta.get("fingerprint") != have:
        raise RankwiseError(
            f"adapter in {path} was trained on base model {meta.get('base_model')!r} "
            f"(fingerprint {meta.get('fingerprint')}), but this model is {model_id(model)!r} "
            f"(fingerprint {have}); load it onto the base model it was trained on")
    _check_weights(model, meta, path)
    keep_training_layout(model)  # a 4-bit base packed by an earlier eval forward is unpacked
    rebuild(model, meta.get("method", {}), name, meta.get("structure") or {},
            meta.get("modules_to_save", []))
    load_adapter_state_dict(model, tensors, name)
    if check:
        from rankwise.core.probe import check_effect
        check_effect(model, name)
    return meta
