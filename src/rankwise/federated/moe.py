"""FedLEASE's client model and its wire names (the layer is
:class:`rankwise.adapters.mixture.MixtureLoraLayer`).

Per adapted layer, M LoRA experts and an adaptive top-M router over ``2M-1`` slots
(:func:`rankwise.adapters.mixture.own_expert_slots`: slots ``0..M-1`` feed the client's own
expert, so it is always selected and a token uses 1..M experts; FedLEASE, Wang et al. 2025,
Sec. 3.3). Weights are not renormalised over the top-M (as in the public reimplementations).

*Wire names* of a converted model: ``expert{m}/<plain factor name>`` for expert m's copy of a
factor, ``cluster{c}/router/<plain A name>`` for the router of the layer owning that A, and
``cluster{c}/<name>`` for the other trainables (the task head). Plain names and the factor
owners come from :func:`rankwise.federated.wire.mark_wire`, recorded before the conversion.
"""
from __future__ import annotations

from torch import nn

from rankwise.adapters.mixture import MixtureLoraLayer, TopKGate, factorized_to_mixture, own_expert_slots
from rankwise.core.protocol import adapter_modules
from rankwise.federated import keys
from rankwise.federated.wire import wire_names, wire_owners

_CLUSTER_ATTR = "_rankwise_fedlease_cluster"


def expert_key(m: int, name: str) -> str:
    """Wire name of expert ``m``'s copy of plain factor ``name``."""
    return keys.EXPERT_PREFIX.format(m=m) + name


def is_expert_key(name: str) -> bool:
    """True for a wire name of any expert's tensor."""
    return name.startswith(keys.EXPERT_PREFIX.split("{")[0])


def cluster_key(c: int, name: str) -> str:
    """Wire name of cluster ``c``'s copy of the (non-factor) trainable ``name``."""
    return keys.CLUSTER_PREFIX.format(c=c) + name


def router_key(c: int, a_name: str) -> str:
    """Wire name of cluster ``c``'s router of the layer whose plain A factor is ``a_name``."""
    return keys.ROUTER_PREFIX.format(c=c) + a_name


def trains_in_cluster(wire_name: str, c: int) -> bool:
    """True for the tensors a client of cluster ``c`` trains: its expert, routers and head."""
    return wire_name.startswith((keys.EXPERT_PREFIX.format(m=c), keys.CLUSTER_PREFIX.format(c=c)))


def is_moe(model: nn.Module) -> bool:
    """True if ``model`` has been converted by :func:`to_moe`."""
    return getattr(model, _CLUSTER_ATTR, None) is not None


def to_moe(model: nn.Module, num_experts: int, own: int, top_m: int) -> None:
    """Turn every factorized adapter (``default``) into FedLEASE's mixture, in place.

    Args:
        model: A plain model of a factorized method (its wire names already marked).
        num_experts: M.
        own: The client's cluster (its own expert).
        top_m: Router slots kept per token.

    Raises:
        RankwiseError: If the model has no factorized adapter (FedLEASE needs one).
    """
    wire_names(model)  # record the plain names before they change
    factorized_to_mixture(model, num_experts, lambda: TopKGate(own_expert_slots(num_experts, own), top_m))
    object.__setattr__(model, _CLUSTER_ATTR, int(own))


def moe_wire_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``{wire name: parameter}`` of a converted model (see module docstring)."""
    own = getattr(model, _CLUSTER_ATTR)
    params = dict(model.named_parameters())
    layers = {path: mod for path, mod in adapter_modules(model) if isinstance(mod, MixtureLoraLayer)}
    owners = wire_owners(model)
    out: dict[str, nn.Parameter] = {}
    for name in wire_names(model):
        path, adapter, role = owners.get(name, (None, None, None))
        if path not in layers:
            out[cluster_key(own, name)] = params[name]
            continue
        layer = layers[path]
        for m in range(layer.num_experts(adapter)):
            out[expert_key(m, name)] = layer.expert_factors(adapter, m)["AB".index(role)]
        if role == "A":
            out[router_key(own, name)] = layer.router(adapter).weight
    return out
