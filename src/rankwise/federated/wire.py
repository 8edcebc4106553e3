"""What a model exchanges: its wire tensors, and which of them are low-rank factors.

A plain model's *wire names* are the parameters its method trains, named as in
``model.named_parameters()``; they are recorded once (:func:`mark_wire`) because local
training changes the ``requires_grad`` flags. A strategy that restructures the model
(FedLEASE's mixtures) names its tensors itself (``AdapterStrategy.wire_parameters``).

*Roles* tell the factors apart: ``{parameter name: "A" | "B"}``, found through the adapter
protocol (``factors(name) -> (A, B)``) and mapped back to parameter names by identity, never
by a substring of the name. The server computes them from its evaluation model, each client
from its own.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import nn

from rankwise.core.protocol import adapter_modules, factors

_WIRE_ATTR = "_rankwise_wire_names"
_OWNER_ATTR = "_rankwise_wire_owners"


def factor_owners(model: nn.Module) -> dict[str, tuple[str, str, str]]:
    """``{parameter name: (layer path, adapter name, "A" | "B")}`` of every low-rank factor.

    Args:
        model: Any model; layers without the ``factors`` capability contribute nothing.

    Returns:
        One entry per factor parameter, in ``named_parameters`` order of discovery.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, tuple[str, str, str]] = {}
    for path, mod in adapter_modules(model):
        for adapter in mod.adapter_names():
            pair = factors(mod, adapter)
            if pair is None:
                continue
            for role, p in zip("AB", pair):
                if id(p) in names:
                    out[names[id(p)]] = (path, adapter, role)
    return out


def factor_roles(model: nn.Module) -> dict[str, str]:
    """``{parameter name: "A" | "B"}`` of every low-rank factor (see module docstring)."""
    return {n: role for n, (_, _, role) in factor_owners(model).items()}


def mark_wire(model: nn.Module, names: Iterable[str]) -> None:
    """Record the plain model's exchangeable parameter names and its factors' owners.

    Args:
        model: The freshly prepared (plain) model.
        names: The parameters its method trains.
    """
    object.__setattr__(model, _WIRE_ATTR, list(names))
    object.__setattr__(model, _OWNER_ATTR, factor_owners(model))


def wire_names(model: nn.Module) -> list[str]:
    """The recorded plain wire names (recorded now from ``requires_grad`` if never marked)."""
    if getattr(model, _WIRE_ATTR, None) is None:
        mark_wire(model, [n for n, p in model.named_parameters() if p.requires_grad])
    return list(getattr(model, _WIRE_ATTR))


def wire_owners(model: nn.Module) -> dict[str, tuple[str, str, str]]:
    """The factor owners recorded by :func:`mark_wire` (plain names; survives restructuring)."""
    wire_names(model)
    return dict(getattr(model, _OWNER_ATTR))


def plain_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``{wire name: parameter}`` of a plain model."""
    params = dict(model.named_parameters())
    return {n: params[n] for n in wire_names(model)}


def load_tensors(params: Mapping[str, nn.Parameter], state: Mapping[str, torch.Tensor]) -> None:
    """Copy received tensors into the parameters of the same wire name.

    Unknown names and tensors of another shape are ignored (the server validates updates; a
    client receives only names the server holds).
    """
    with torch.no_grad():
        for k, v in state.items():
            if k in params and params[k].shape == v.shape:
                params[k].copy_(v.to(params[k].dtype))


def set_trainable(model: nn.Module, params: Iterable[nn.Parameter]) -> None:
    """Make exactly ``params`` trainable in ``model``."""
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
