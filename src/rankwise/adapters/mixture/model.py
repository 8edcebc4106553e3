"""Model glue: turn every low-rank adapter of a model into a mixture of LoRA experts.

Works through the protocol only: any layer whose adapter exposes ``factors`` (LoRA, GoRA)
is converted, with the rank, alpha and rsLoRA flag its ``describe`` reports.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from rankwise.adapters.mixture.layer import Gate, MixtureLoraLayer
from rankwise.core.inject import replace_module
from rankwise.core.protocol import adapter_modules, describe, factors
from rankwise.core.token_mask import track_token_mask
from rankwise.errors import RankwiseError


def factorized_to_mixture(model: nn.Module, num_experts: int, make_gate: Callable[[], Gate],
                          adapter_name: str = "default", copy_factors: bool = True
                          ) -> dict[str, MixtureLoraLayer]:
    """Replace adapter ``adapter_name`` of every factorized layer by a mixture, in place.

    Each converted layer gets a :class:`MixtureLoraLayer` holding mixture ``adapter_name``
    with ``num_experts`` experts of the adapter's rank, alpha and rsLoRA flag, a zero router
    and the gate ``make_gate()`` (one gate per layer). The layer's other adapters, if any,
    stay (the mixture then wraps that layer); a layer left without adapters is dropped and
    the mixture wraps its base layer. New parameters train if the old factors did.

    Args:
        model: A model with a factorized adapter (``method: lora`` or ``gora``).
        num_experts: M.
        make_gate: Builds a gate (router logits -> expert weights) for one layer.
        adapter_name: The adapter to convert.
        copy_factors: Start every expert as a copy of the old ``(A, B)``; else the LoRA init.

    Returns:
        ``{layer path: MixtureLoraLayer}``.

    Raises:
        RankwiseError: If no layer has a factorized adapter ``adapter_name``.
    """
    found = [(path, mod, pair) for path, mod in adapter_modules(model)
             if adapter_name in mod.adapter_names()
             and (pair := factors(mod, adapter_name)) is not None]
    if not found:
        raise RankwiseError(f"no adapter layer exposes low-rank factors for adapter {adapter_name!r}; "
                            "a mixture of LoRA experts needs a factorized method (method.name: lora or gora)")
    out = {}
    for path, mod, (a, b) in found:
        info = describe(mod, adapter_name)
        trains = a.requires_grad
        a, b = a.detach().clone(), b.detach().clone()
        mod.delete(adapter_name)
        base = mod if mod.adapter_names() else mod.base_layer
        layer = MixtureLoraLayer(base)
        mix = layer.add(adapter_name, num_experts, int(info.get("r", a.shape[0])),
                        float(info.get("alpha", a.shape[0])), make_gate(),
                        use_rslora=bool(info.get("use_rslora", False)))
        if copy_factors:
            with torch.no_grad():
                for e in mix.experts:
                    e.lora_A.weight.copy_(a)
                    e.lora_B.weight.copy_(b)
        for p in layer.adapter_params(adapter_name).values():
            p.requires_grad_(trains)
        replace_module(model, path, layer)
        out[path] = layer
    track_token_mask(model)  # padding stays out of the balance loss and the load
    return out
