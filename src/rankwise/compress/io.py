"""``compression.safetensors``: the compact form of every compressed layer, self-describing.

Tensors are stored as ``"<module path>::<key>"`` (``model.layers.0.mlp.up_proj::values``);
the file's metadata ``rankwise_compression`` holds the method, its resolved config and each
layer's shape, so :func:`load_compressed` can decode every layer without calibration data
through the registered compressor's ``decode``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rankwise.compress.base import Compressed
from rankwise.errors import RankwiseError

META_KEY = "rankwise_compression"


def save_compressed(path: Path, method: str, config: dict[str, Any],
                    layers: dict[str, Compressed]) -> Path:
    """Write the compact form of ``layers``.

    Args:
        path: The ``.safetensors`` file to write.
        method: The compressor's registry name.
        config: Its resolved config as plain data.
        layers: ``{module path: Compressed}``.

    Returns:
        ``path``.
    """
    from safetensors.torch import save_file
    tensors = {f"{p}::{k}": t.contiguous() for p, comp in layers.items() for k, t in comp.tensors.items()}
    meta = {"method": method, "config": config,
            "layers": {p: {"shape": list(comp.weight.shape)} for p, comp in layers.items()}}
    save_file(tensors, str(path), metadata={META_KEY: json.dumps(meta)})
    return Path(path)


def load_compressed(path: Path) -> dict[str, torch.Tensor]:
    """Decode every layer of a ``compression.safetensors`` file.

    Args:
        path: The file.

    Returns:
        ``{module path: decoded (out, in) float32 weight}``.

    Raises:
        RankwiseError: If the file is missing or was not written by :func:`save_compressed`.
    """
    from safetensors import safe_open

    from rankwise import registry
    from rankwise.configs import from_dict
    path = Path(path)
    if not path.is_file():
        raise RankwiseError(f"{path} not found; pass the compression.safetensors of a "
                            "'rankwise compress' output folder")
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(META_KEY)
        if raw is None:
            raise RankwiseError(f"{path} has no {META_KEY} metadata; it was not written by rankwise compress")
        meta = json.loads(raw)
        entry = registry.get("compressor", meta["method"])
        compressor = entry.builder(from_dict(entry.config_cls, meta["config"], "compress"))
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        for key in f.keys():
            layer, _, name = key.rpartition("::")
            grouped.setdefault(layer, {})[name] = f.get_tensor(key)
    return {p: compressor.decode(grouped[p], tuple(info["shape"])) for p, info in meta["layers"].items()}
