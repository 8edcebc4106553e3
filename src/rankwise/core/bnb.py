"""The two bitsandbytes layer types read as dense weights: ``Linear4bit`` (NF4/FP4, QLoRA) and
``Linear8bitLt`` (LLM.int8).

Nothing here imports bitsandbytes unless it is already loaded (only a process that imported it
can hold such a layer). :mod:`rankwise.core.weights` registers the two dequantizers from here
the first time it reads a layer; what works on a whole quantized model (keeping the training
layout, the merged export's dequantization, byte counts) is :mod:`rankwise.core.quant`, which
reads weights through :mod:`rankwise.core.weights` (so this module is the one both import, and
neither imports the other's way back).

The CPU repacking caveat: on a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight into a
kernel-specific layout the first time the layer runs an inference forward;
:func:`dequantize_4bit` reads both layouts (see :mod:`rankwise.core.quant`).
"""
from __future__ import annotations

import copy
import logging
import sys

import torch
from torch import nn

_REGISTERED = False
# bitsandbytes 0.50 logs this at import on an AVX512-BF16 CPU without the optional ``kernels``
# package, then uses its own 4-bit kernel: nothing is wrong, so a run does not print it.
OPTIONAL_KERNEL = "Failed to load CPU gemm_4bit_forward from kernels-community"


def _not_optional_kernel(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(OPTIONAL_KERNEL)


# the logger exists before bitsandbytes is imported, and keeps its filter when bitsandbytes gets it
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_optional_kernel)


def bnb_loaded() -> bool:
    """True once bitsandbytes has been imported in this process."""
    return "bitsandbytes" in sys.modules


def _bnb_classes() -> tuple[type, type]:
    import bitsandbytes as bnb
    return bnb.nn.Linear4bit, bnb.nn.Linear8bitLt


def is_4bit(layer: nn.Module) -> bool:
    """True if ``layer`` is a bitsandbytes ``Linear4bit`` (NF4/FP4)."""
    return bnb_loaded() and isinstance(layer, _bnb_classes()[0])


def is_packed_for_cpu(layer: nn.Module) -> bool:
    """True if a ``Linear4bit`` weight is in bitsandbytes' CPU inference layout."""
    state = getattr(getattr(layer, "weight", None), "quant_state", None)
    return bool(getattr(state, "packing_format_for_cpu", False))


def dequantize_4bit(layer: nn.Module) -> torch.Tensor:
    """The dense ``(out, in)`` weight of a bitsandbytes ``Linear4bit``, in its compute dtype.

    Reads the CPU inference layout too (through bitsandbytes' inverse of the repacking,
    applied to copies, so the layer is not changed).

    Args:
        layer: A ``bnb.nn.Linear4bit``.

    Returns:
        A new tensor of shape ``(out_features, in_features)``.
    """
    import bitsandbytes.functional as F
    data, state = layer.weight.data, layer.weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        data, state = F._convert_weight_packed_for_cpu_inverse(data.clone(), copy.deepcopy(state))
        if getattr(state, "original_storage_type", None) is not None:
            data = data.view(state.original_storage_type)
    return F.dequantize_4bit(data, state)


def dequantize_8bit(layer: nn.Module) -> torch.Tensor:
    """The dense ``(out, in)`` float32 weight of a bitsandbytes ``Linear8bitLt``
    (``int8 row * row scale / 127``).

    Args:
        layer: A ``bnb.nn.Linear8bitLt`` holding int8 weights.

    Returns:
        A new float32 tensor of shape ``(out_features, in_features)``.
    """
    import bitsandbytes.functional as F
    scb = getattr(layer.weight, "SCB", None)
    if scb is None:
        scb = layer.state.SCB
    return F.int8_vectorwise_dequant(layer.weight.data, scb)


def register(dequantizers: dict) -> None:
    """Put the bitsandbytes dequantizers into ``dequantizers`` (``type -> fn``; it is
    :data:`rankwise.core.weights.DEQUANTIZERS`); a no-op until bitsandbytes is imported."""
    global _REGISTERED
    if _REGISTERED or not bnb_loaded():
        return
    four, eight = _bnb_classes()
    dequantizers[four] = dequantize_4bit
    dequantizers[eight] = dequantize_8bit
    _REGISTERED = True
