"""Export a merged model: adapters folded into the base weights, saved for ``from_pretrained``."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise.core import atomic
from rankwise.core.ops import check_mergeable, merge_and_unload
from rankwise.core.inject import replace_module
from rankwise.core.protocol import adapter_modules, merges_on_grid
from rankwise.core.quant import dequantize_model, quantized_paths
from rankwise.core.tokenizer_files import save_tokenizer_files
from rankwise.errors import RankwiseError


def merge_plain(model: nn.Module, adapter_name: str | None = None,
                dtype: torch.dtype | None = None) -> nn.Module:
    """Fold the adapters into the base weights in place and strip the adapter layers: the
    model :func:`export_merged` writes (``rankwise compress`` of a run compresses this one).

    A layer whose merge is arithmetic on its own quantized base (the ``merges_on_grid``
    capability: LoTA-QAF's integer merge ``q <- q + m``, ``z <- z - zp``) merges first, and the
    merged grid is then dequantized (in the model's float dtype unless ``dtype`` says
    otherwise). Any other quantized base (bitsandbytes) is dequantized first (bf16 unless
    ``dtype`` says otherwise), so the adapter is added to exactly the weights it was trained
    against.

    Args:
        model: An adapted model (changed in place).
        adapter_name: Merge only this adapter; ``None`` merges the active adapters.
        dtype: Cast the merged model to this dtype (default: bf16 for a quantized base, else
            as it is).

    Returns:
        The plain model.

    Raises:
        RankwiseError: If an adapter layer is not mergeable.
    """
    check_mergeable(model)
    on_grid = []
    for path, mod in list(adapter_modules(model)):
        if merges_on_grid(mod):  # merged on its integer grid, dequantized below
            for n in ([adapter_name] if adapter_name else mod.active_names()):
                if n in mod.adapter_names():
                    mod.merge(n)
            replace_module(model, path, mod.base_layer)
            on_grid.append(path)
    quantized = quantized_paths(model)
    if quantized:
        floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
        own_grid_only = set(quantized) <= set(on_grid) and floats
        dtype = dtype or (floats[0] if own_grid_only else torch.bfloat16)
        dequantize_model(model, dtype)
    model = merge_and_unload(model, adapter_name)
    if dtype is not None:
        model.to(dtype)
        if getattr(model, "config", None) is not None:
            model.config.dtype = dtype
    return model


def export_merged(model: nn.Module, out_dir: str | Path, tokenizer: Any = None,
                  adapter_name: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """Save a copy of ``model`` with its adapters merged, as a plain transformers model folder.

    The caller's model is not changed: a deep copy is merged (``W + s B A`` per layer, see
    :func:`rankwise.core.ops.merge_and_unload`), stripped of adapter layers, and written with
    ``save_pretrained`` (safetensors), so ``transformers.AutoModel*.from_pretrained(out_dir)``
    loads it without rankwise. Trained whole modules (the head) are part of the model already.

    A quantized base (bitsandbytes 4-bit/8-bit) is first dequantized - layer by layer, into the
    very weights the adapter was trained against, not the original 16-bit checkpoint - and the
    merged model is saved in bf16 unless ``dtype`` says otherwise (see
    :func:`rankwise.core.quant.dequantize_model`). Each merged weight is summed in float32 and
    rounded once.

    Args:
        model: An adapted transformers model (a ``PreTrainedModel``).
        out_dir: Target folder (replaced only when writing succeeded).
        tokenizer: Optional tokenizer saved beside the weights, with every tokenizer file of
            the folder it was loaded from (:mod:`rankwise.core.tokenizer_files`).
        adapter_name: Merge only this adapter; ``None`` merges the active adapters.
        dtype: Dtype of the saved weights (default: bf16 for a quantized base, else as they are).

    Returns:
        The folder written.

    Raises:
        RankwiseError: If ``model`` has no ``save_pretrained`` (not a transformers model) or
            an adapter layer is not mergeable.
    """
    if not callable(getattr(model, "save_pretrained", None)):
        raise RankwiseError(f"cannot export a merged {type(model).__name__}: it is not a "
                            "transformers model (no save_pretrained); save its state_dict instead")
    check_mergeable(model)
    if adapter_name is not None:
        names = {n for _, m in adapter_modules(model) for n in m.adapter_names()}
        if adapter_name not in names:
            raise RankwiseError(f"no adapter named {adapter_name!r}; adapters here: {sorted(names)}")
    merged = merge_plain(copy.deepcopy(model), adapter_name, dtype)
    out_dir = Path(out_dir)
    with atomic.folder(out_dir) as tmp:
        merged.save_pretrained(str(tmp))
        if tokenizer is not None:  # with the base's tokenizer.model, chat template, ...
            save_tokenizer_files(tokenizer, tmp)
        if not any(tmp.glob("*.safetensors")):
            raise RuntimeError(f"save_pretrained wrote no safetensors file in {tmp}")
    return out_dir
