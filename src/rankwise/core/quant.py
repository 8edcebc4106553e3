"""Quantized base layers (bitsandbytes) across a whole model: keeping them trainable, and turning
a quantized model back into a plain one for the merged export.

rankwise never quantizes a layer itself: transformers does, from a ``BitsAndBytesConfig``
(``model.quantize``). Reading one layer's weight as a dense ``(out, in)`` matrix is
:mod:`rankwise.core.bnb` (registered in :mod:`rankwise.core.weights`); this module reads
weights through :mod:`rankwise.core.weights`, never the other way round.

The CPU repacking caveat. On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight into a
kernel-specific layout (and rounds the block scales to bf16) the first time the layer runs an
inference forward. Three consequences are handled here:

* :func:`dequantize_4bit` reads both layouts (the packed one through bitsandbytes' own inverse,
  on copies); decoding the packed bytes as if they were the training layout gives garbage.
* :func:`keep_training_layout` (called when an adapter is applied) switches the repacking off
  for the model's 4-bit layers and unpacks any already repacked: once repacked, bitsandbytes
  also runs *training* forwards through the inference kernel, which has no backward, and the
  evaluations of a run would use rounded scales the training never saw.
* the merged export dequantizes what the adapter was trained against (:func:`dequantize_model`).
"""
from __future__ import annotations

import torch
from torch import nn

# the layer-level readers live in core/bnb.py (which core/weights.py imports); named here too,
# where callers have always found them
from rankwise.core.bnb import (OPTIONAL_KERNEL, _bnb_classes, bnb_loaded, dequantize_4bit,  # noqa: F401
                               dequantize_8bit, is_4bit, is_packed_for_cpu)


def quantized_paths(model: nn.Module) -> list[str]:
    """Paths of the model's quantized base layers (wrapped ones included)."""
    from rankwise.core.weights import is_quantized
    from rankwise.core.inject import is_wrapped
    return [p for p, m in model.named_modules() if p and not is_wrapped(m) and is_quantized(m)]


def keep_training_layout(model: nn.Module) -> int:
    """Stop bitsandbytes from repacking the model's 4-bit weights for CPU inference, and
    unpack any it already repacked (see the module docstring).

    Args:
        model: Any model (a no-op without 4-bit layers).

    Returns:
        How many layers were unpacked.
    """
    if not bnb_loaded():
        return 0
    import bitsandbytes.functional as F
    four, _ = _bnb_classes()
    unpacked = 0
    for m in model.modules():
        if not isinstance(m, four):
            continue
        m.support_avx512bf16_for_cpu = False
        if is_packed_for_cpu(m):
            m.weight.data, m.weight.quant_state = F._convert_weight_packed_for_cpu_inverse(
                m.weight.data, m.weight.quant_state)
            storage = getattr(m.weight.quant_state, "original_storage_type", None)
            if storage is not None:
                m.weight.data = m.weight.data.view(storage)
            unpacked += 1
    return unpacked


def dequantize_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Replace every quantized base layer by an ``nn.Linear`` holding its dequantized weight,
    cast the rest of the model to ``dtype``, and drop the quantization settings from its
    config, so ``save_pretrained`` writes a plain model (in place).

    Adapter layers stay; their base layer is replaced under them, so a following merge adds
    the adapter to exactly the weights it was trained against.

    Args:
        model: A model loaded with a ``BitsAndBytesConfig`` (possibly adapted).
        dtype: The dtype of the plain model (bf16 for the merged export of a 4-bit base).

    Returns:
        ``model``.
    """
    from rankwise.core.inject import replace_module
    from rankwise.core.protocol import adapter_modules
    from rankwise.core.weights import dense_weight, shape
    for path in quantized_paths(model):
        layer = model.get_submodule(path)
        out_f, in_f = shape(layer)
        dense = nn.Linear(in_f, out_f, bias=layer.bias is not None, dtype=dtype,
                          device=layer.weight.device)
        with torch.no_grad():
            dense.weight.copy_(dense_weight(layer).to(dtype))
            if layer.bias is not None:
                dense.bias.copy_(layer.bias.to(dtype))
        dense.weight.requires_grad_(False)
        if dense.bias is not None:
            dense.bias.requires_grad_(False)
        replace_module(model, path, dense)
    adapters = {id(p) for _, m in adapter_modules(model) for n in m.adapter_names()
                for p in m.adapter_params(n).values()}  # merged in float32 later, then cast
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype and id(p) not in adapters:
            p.data = p.data.to(dtype)
    _forget_quantization(model)
    if getattr(model, "config", None) is not None:
        model.config.dtype = dtype
    return model


def _forget_quantization(model: nn.Module) -> None:
    """Drop what transformers records about a quantized load (its quantizer, the config's
    ``quantization_config``, the flags that forbid ``.to(dtype)``), as its own
    ``remove_quantization_config`` does."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method", "_weight_conversions"):
        if attr in vars(model):
            delattr(model, attr)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    for attr in ("is_loaded_in_4bit", "is_loaded_in_8bit", "is_quantized"):
        if getattr(model, attr, False):
            setattr(model, attr, False)


def _state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors a quantized layer keeps outside its parameters: 4-bit block scales (and their
    own scales and code tables under double quantization), 8-bit row scales."""
    out: list[torch.Tensor] = []
    weight = getattr(module, "weight", None)
    qs = getattr(weight, "quant_state", None)
    for obj in (qs, getattr(qs, "state2", None)):
        for name in ("absmax", "code", "offset"):
            t = getattr(obj, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    for holder in (weight, getattr(module, "state", None)):
        for name in ("SCB", "CB"):
            t = getattr(holder, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def model_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model holds: parameters, buffers and the quantization state of
    bitsandbytes layers (each storage counted once).

    Args:
        model: Any model.

    Returns:
        The total in bytes.
    """
    from rankwise.memory import tensor_bytes
    extra = [t for m in model.modules() for t in _state_tensors(m)] if bnb_loaded() else []
    return tensor_bytes(model, extra)


__all__ = ["bnb_loaded", "register", "dequantize_4bit", "dequantize_8bit", "is_packed_for_cpu",
           "quantized_paths", "keep_training_layout", "dequantize_model", "model_bytes"]
