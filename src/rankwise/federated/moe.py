"""FedLEASE's client model: per adapted layer, M LoRA experts and an adaptive top-M router.

``y = W0 x + sum_{p in TopM(softmax(G x))} w_p s B_{e(p)} A_{e(p)} x`` with ``G`` of shape
(2M-1, d_in): router slots 0..M-1 all map to the client's own expert, slots M..2M-2 to the
M-1 other experts, so the own expert is always selected and a client uses 1..M experts per
token (FedLEASE, Wang et al. 2025, Sec. 3.3). Weights are not renormalised over the top-M
(as in the public reimplementations). The router reads the layer input (token level).

*Wire names* (what travels): a plain model sends its trainable parameter names; a MoE model
sends ``expert{m}/<plain LoRA name>`` for expert m and ``cluster{c}/<name>`` for its router
(``<layer path>.router.weight``) and other trainables (the task head).
"""
from __future__ import annotations

import torch
from torch import nn

from rankwise.federated import keys

_WIRE_ATTR = "_rankwise_wire_names"


def mark_wire(model: nn.Module, names: list[str]) -> None:
    """Record the plain model's exchangeable parameter names (those its method trains)."""
    object.__setattr__(model, _WIRE_ATTR, list(names))


def expert_key(m: int, name: str) -> str:
    """Wire name of expert ``m``'s copy of plain LoRA parameter ``name``."""
    return keys.EXPERT_PREFIX.format(m=m) + name


def is_expert_key(name: str) -> bool:
    """True for a wire name of any expert's tensor."""
    return name.startswith(keys.EXPERT_PREFIX.split("{")[0])


def cluster_key(c: int, name: str) -> str:
    """Wire name of cluster ``c``'s router/head parameter ``name``."""
    return keys.CLUSTER_PREFIX.format(c=c) + name


def trains_in_cluster(wire_name: str, c: int) -> bool:
    """True for the tensors a client of cluster ``c`` trains: its expert, router and head."""
    return wire_name.startswith(keys.EXPERT_PREFIX.format(m=c)) or wire_name.startswith(
        keys.CLUSTER_PREFIX.format(c=c))


class MoeLoraLayer(nn.Module):
    """A LoRA layer holding experts ``e0..e{M-1}`` mixed by an adaptive top-M router.

    Args:
        lora: A ``LoraLayer`` whose adapters ``e0..e{M-1}`` are the experts (inactive in it).
        num_experts: M.
        own: Index of the client's own expert (its cluster).
        top_m: Slots selected per token (the paper uses M).
    """

    def __init__(self, lora: nn.Module, num_experts: int, own: int, top_m: int) -> None:
        super().__init__()
        self.lora, self.num_experts, self.own, self.top_m = lora, num_experts, own, top_m
        w = lora.base_layer.weight
        self.router = nn.Linear(lora.in_features, 2 * num_experts - 1, bias=False,
                                device=w.device, dtype=torch.float32)
        nn.init.zeros_(self.router.weight)
        others = [m for m in range(num_experts) if m != own]
        slot_map = torch.zeros(2 * num_experts - 1, num_experts)  # (slots, experts)
        slot_map[:num_experts, own] = 1.0
        for j, m in enumerate(others):
            slot_map[num_experts + j, m] = 1.0
        self.register_buffer("slot_map", slot_map, persistent=False)

    def expert_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token expert weights ``(..., M)``: top-M slot probabilities summed per expert."""
        probs = torch.softmax(self.router(x.float()), dim=-1)          # (..., 2M-1)
        k = min(self.top_m, probs.shape[-1])
        top = probs.topk(k, dim=-1)
        kept = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
        return kept @ self.slot_map                                     # (..., M)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Base output plus the router-weighted experts."""
        out = self.lora.base_layer(x)
        w = self.expert_weights(x)
        for m in range(self.num_experts):
            a, b = self.lora.lora_A[f"e{m}"], self.lora.lora_B[f"e{m}"]
            delta = b(a(x.to(a.weight.dtype))) * self.lora.scaling[f"e{m}"]
            out = out + (w[..., m:m + 1] * delta).to(out.dtype)
        return out


def is_moe(model: nn.Module) -> bool:
    """True if ``model`` has been converted by :func:`to_moe`."""
    return any(isinstance(m, MoeLoraLayer) for m in model.modules())


def to_moe(model: nn.Module, num_experts: int, own: int, top_m: int) -> None:
    """Turn every LoRA layer (adapter ``default``) into a :class:`MoeLoraLayer` in place.

    Raises:
        RankwiseError: If the model has no LoRA layers (FedLEASE needs ``method: lora``).
    """
    from rankwise.adapters.lora import LoraLayer
    from rankwise.errors import RankwiseError
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    if not layers:
        raise RankwiseError("fedlease needs LoRA layers; set method.name: lora")
    for path, layer in layers:
        r, alpha, rs = layer.ranks["default"], layer.alphas["default"], layer.rslora["default"]
        for m in range(num_experts):
            layer.add(f"e{m}", r, alpha, 0.0, rs)
        layer.delete("default")
        layer.set_active([])
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, MoeLoraLayer(layer, num_experts, own, top_m))


def wire_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``{wire name: parameter}`` of the tensors this model exchanges (see module docstring)."""
    params = dict(model.named_parameters())
    plain = getattr(model, _WIRE_ATTR, None)
    if plain is None:
        plain = [n for n, p in params.items() if p.requires_grad]
        mark_wire(model, plain)
    if not is_moe(model):
        return {n: params[n] for n in plain}
    out: dict[str, nn.Parameter] = {}
    moe = {path: mod for path, mod in model.named_modules() if isinstance(mod, MoeLoraLayer)}
    for name in plain:
        for path, mod in moe.items():
            for factor in ("lora_A", "lora_B"):
                if name.startswith(f"{path}.{factor}."):
                    for m in range(mod.num_experts):
                        out[expert_key(m, name)] = getattr(mod.lora, factor)[f"e{m}"].weight
                    break
            else:
                continue
            break
        else:
            out[cluster_key(next(iter(moe.values())).own, name)] = params[name]
    for path, mod in moe.items():
        out[cluster_key(mod.own, f"{path}.router.weight")] = mod.router.weight
    return out
