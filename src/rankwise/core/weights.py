"""The one accessor for a (possibly wrapped, possibly quantized) layer's weight.

Adapters, GoRA's importance, YOCO's sign targets, merging and the base-model fingerprint all
read a layer's weight through here, in one layout - ``(out_features, in_features)`` - whatever
the storage: ``nn.Linear`` stores ``(out, in)``, GPT-2's ``Conv1D`` stores ``(in, out)``, and a
quantized layer stores packed integers that only its own dequantization can read. Nobody
else touches packed storage.
"""
from __future__ import annotations

import torch
from torch import nn

from rankwise.core import bnb
from rankwise.core.inject import is_conv1d

# Quantized layer types register a dequantizer here: ``type -> fn(module) -> (out, in) tensor``.
# bitsandbytes' layers are registered from ``core/bnb.py`` once bitsandbytes is imported.
DEQUANTIZERS: dict[type, callable] = {}


def base_layer(module: nn.Module) -> nn.Module:
    """The innermost layer under any adapter wrappers (``module.base_layer.base_layer...``)."""
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    return module


def _dequantizer(layer: nn.Module):
    bnb.register(DEQUANTIZERS)  # no-op until bitsandbytes is imported (only then can its layers exist)
    for cls in type(layer).__mro__:
        if cls in DEQUANTIZERS:
            return DEQUANTIZERS[cls]
    return None


def is_quantized(module: nn.Module) -> bool:
    """True if the base layer stores its weight packed (it has a registered dequantizer)."""
    return _dequantizer(base_layer(module)) is not None


def shape(module: nn.Module) -> tuple[int, int]:
    """``(out_features, in_features)`` of a linear-like layer (wrapped or not)."""
    layer = base_layer(module)
    if is_conv1d(layer):
        n_in, n_out = layer.weight.shape
        return int(n_out), int(n_in)
    return int(layer.out_features), int(layer.in_features)


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The base layer's weight as a dense ``(out, in)`` tensor.

    For plain layers this is a view of the parameter (transposed for ``Conv1D``); for a
    quantized layer it is a freshly dequantized tensor. Merges and adapter deltas are not
    included: this is the frozen base as stored.

    Args:
        module: A linear-like layer or an adapter layer wrapping one.

    Returns:
        A tensor of shape :func:`shape` ``(module)``.
    """
    layer = base_layer(module)
    deq = _dequantizer(layer)
    if deq is not None:
        return deq(layer)
    return layer.weight.T if is_conv1d(layer) else layer.weight


def storage_param(module: nn.Module) -> nn.Parameter:
    """The parameter that stores the base weight (for autograd hooks and in-place merges).

    Raises:
        TypeError: For a quantized layer: its storage is packed and must not be read as a
            matrix (use :func:`dense_weight`).
    """
    layer = base_layer(module)
    if _dequantizer(layer) is not None:
        raise TypeError(f"{type(layer).__name__} stores a packed weight; use dense_weight()")
    return layer.weight


def to_storage_layout(module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """Map an ``(out, in)`` tensor to the layout the base layer stores (``(in, out)`` for Conv1D)."""
    return t.T if is_conv1d(base_layer(module)) else t


def logical_shapes(model: nn.Module) -> dict[str, list[int]]:
    """``{parameter name: shape}`` of the base model, with adapter weights left out and each
    quantized weight reported by its logical ``(out, in)`` shape (so a 4-bit model has the
    fingerprint of its full-precision original)."""
    from rankwise.core.protocol import adapter_modules
    adapter_ids = {id(p) for _, m in adapter_modules(model) for n in m.adapter_names()
                   for p in m.adapter_params(n).values()}
    quantized = {id(base_layer(m).weight): list(shape(m)) for _, m in model.named_modules()
                 if _dequantizer(m) is not None}
    out = {}
    for name, p in model.named_parameters():
        if id(p) in adapter_ids:
            continue
        out[name.replace(".base_layer", "")] = quantized.get(id(p), list(p.shape))
    return out


SAMPLES_PER_TABLE = 16


def weight_sample(model: nn.Module, skip: list[str] | tuple[str, ...] = ()) -> dict:
    """A few values of the base model's embedding tables: the cheap weight checksum that an
    adapter file keeps beside the shape fingerprint, so that a base with the same shapes but
    other weights is caught (:func:`sample_mismatch`).

    Embedding tables are chosen because nothing else in rankwise changes them: bitsandbytes
    quantizes only linear layers (a QLoRA adapter still loads onto its 16-bit base), and no
    method rewrites them (LoTA-QAF requantizes, and factorized low-rank layers release, linear
    weights). From each table (adapter parameters and ``skip`` modules - trained heads - left
    out) ``SAMPLES_PER_TABLE`` values are read at fixed positions, one in each sixteenth of the
    flattened table.

    Args:
        model: The base model, adapted or not (names are taken without ``.base_layer``).
        skip: Module paths whose parameters train with the adapter (``modules_to_save``).

    Returns:
        ``{"dtype": storage dtype, "tables": {parameter name: [float, ...]}}``; no tables for
        a model without ``nn.Embedding``.
    """
    from rankwise.core.protocol import adapter_modules
    adapter_ids = {id(p) for _, m in adapter_modules(model) for n in m.adapter_names()
                   for p in m.adapter_params(n).values()}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out, dtype = {}, None
    for name, p in model.named_parameters():
        key = name.replace(".base_layer", "")
        if id(p) not in tables or id(p) in adapter_ids or any(
                key.startswith(f"{s}.") for s in skip):
            continue
        flat = p.detach().reshape(-1)
        n = flat.numel()
        if n == 0:
            continue
        k = torch.arange(SAMPLES_PER_TABLE)
        stride = n // SAMPLES_PER_TABLE
        idx = k * stride + (k * 7919) % stride if stride else k % n
        out[key] = flat[idx.to(flat.device)].double().cpu().tolist()
        dtype = dtype or str(p.dtype).removeprefix("torch.")
    return {"dtype": dtype, "tables": out}


def sample_mismatch(saved: dict, now: dict) -> str | None:
    """The first embedding table whose sampled values differ, or ``None`` if they agree.

    Values must be equal when both samples were stored in one dtype; across dtypes (an adapter
    trained on a bf16 base loaded onto the float32 original) each may differ by the rounding
    of the coarser dtype.

    Args:
        saved: :func:`weight_sample` at save time.
        now: :func:`weight_sample` of the model being loaded onto.

    Returns:
        A parameter name, or ``None``.
    """
    dtypes = [getattr(torch, d, None) for d in (saved.get("dtype"), now.get("dtype"))]
    same = dtypes[0] == dtypes[1]
    finfo = [torch.finfo(d) for d in dtypes if isinstance(d, torch.dtype) and d.is_floating_point]
    rtol = 0.0 if same or not finfo else max(f.eps for f in finfo)
    atol = 0.0 if same or not finfo else max(f.tiny for f in finfo)
    for name, values in saved.get("tables", {}).items():
        have = now.get("tables", {}).get(name)
        if have is None or len(have) != len(values):
            return name
        a, b = torch.tensor(values, dtype=torch.float64), torch.tensor(have, dtype=torch.float64)
        if not torch.allclose(a, b, rtol=rtol, atol=atol):
            return name
    return None


def quantized_numel(model: nn.Module) -> dict[int, int]:
    """``{id(storage parameter): out * in}`` for every quantized base layer of ``model``."""
    out = {}
    for _, m in model.named_modules():
        if _dequantizer(m) is not None:
            n_out, n_in = shape(m)
            out[id(m.weight)] = n_out * n_in
    return out
