"""A mixture of LoRA experts behind a router (an ``AdapterModule``).

For one named adapter with experts ``m = 0..M-1`` (each a LoRA pair ``A_m (r, in)``,
``B_m (out, r)``), a router ``G (S, in)`` with ``S`` slots and a *gate* ``g`` that turns the
router logits into per-expert weights::

    y = W0 x + sum_m g(G x)_m * s * B_m A_m x          # g(G x): (..., M)

The router reads the layer input, so the weights change per token: the adapter cannot be
folded into ``W0`` (``mergeable = False``; :func:`rankwise.core.merge_adapters` refuses it).

:class:`TopKGate` is the gate used by FedLEASE (Wang et al., NeurIPS 2025, Sec. 3.3) and by
plain top-k MoE-LoRA: softmax over the slots, keep the ``k`` largest slot probabilities (no
renormalisation), sum the kept slots of each expert. A *slot layout* (``slot_experts``, the
expert each slot feeds) makes FedLEASE's adaptive top-M a layout rather than a subclass:
:func:`own_expert_slots` gives its ``2M-1`` slots, ``0..M-1`` all feeding the client's own
expert, so the own expert is always selected and a token uses 1..M experts.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.adapters.lora.layer import LORA_INITS, lora_scale
from rankwise.core import weights as W
from rankwise.errors import RankwiseError

Gate = Callable[[torch.Tensor], torch.Tensor]  # router logits (..., S) -> expert weights (..., M)


def own_expert_slots(num_experts: int, own: int) -> list[int]:
    """FedLEASE's slot layout: ``2M-1`` slots; slots ``0..M-1`` feed expert ``own``, slots
    ``M..2M-2`` feed the other experts in increasing order.

    Args:
        num_experts: M.
        own: The client's own expert, ``0..M-1``.

    Returns:
        The expert index of every slot (length ``2M-1``).

    Raises:
        ValueError: If ``own`` is not an expert index.
    """
    if not 0 <= own < num_experts:
        raise ValueError(f"own expert: got {own!r}; expected 0..{num_experts - 1}")
    return [own] * num_experts + [m for m in range(num_experts) if m != own]


class TopKGate(nn.Module):
    """Softmax over router slots, keep the top ``k`` slot probabilities, sum them per expert.

    Args:
        slot_experts: The expert each router slot feeds (``list(range(M))``: one slot per
            expert, ordinary top-k routing; :func:`own_expert_slots`: FedLEASE).
        top_k: Slots kept per token (clipped to the number of slots).

    Raises:
        ValueError: If ``slot_experts`` is empty or ``top_k < 1``.
    """

    def __init__(self, slot_experts: list[int], top_k: int) -> None:
        super().__init__()
        if not slot_experts or min(slot_experts) < 0:
            raise ValueError(f"slot_experts: got {slot_experts!r}; expected expert indices >= 0")
        if top_k < 1:
            raise ValueError(f"top_k: got {top_k!r}; expected an integer >= 1")
        self.slot_experts, self.top_k = [int(m) for m in slot_experts], int(top_k)
        slot_map = torch.zeros(len(slot_experts), max(slot_experts) + 1)  # (S, M)
        slot_map[torch.arange(len(slot_experts)), torch.tensor(self.slot_experts)] = 1.0
        self.register_buffer("slot_map", slot_map, persistent=False)

    @property
    def slots(self) -> int:
        """Router outputs S."""
        return len(self.slot_experts)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        """Expert weights ``(..., M)`` from router logits ``(..., S)``."""
        probs = torch.softmax(logits.float(), dim=-1)                       # (..., S)
        top = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
        kept = torch.zeros_like(probs).scatter(-1, top.indices, top.values)  # (..., S)
        return kept @ self.slot_map                                         # (..., M)

    def describe(self) -> dict[str, Any]:
        """JSON structure that rebuilds this gate."""
        return {"kind": "top-k", "slot_experts": list(self.slot_experts), "top_k": self.top_k}


class LoraExpert(nn.Module):
    """One expert: a LoRA pair (``lora_A``: in -> r, ``lora_B``: r -> out), bias-free."""

    def __init__(self, n_in: int, n_out: int, r: int, device=None, dtype=None) -> None:
        super().__init__()
        self.lora_A = nn.Linear(n_in, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, n_out, bias=False, device=device, dtype=dtype)


class LoraMixture(nn.Module):
    """One named adapter of a :class:`MixtureLoraLayer`: experts, router, gate, scale.

    Args:
        n_in: Input features of the adapted layer.
        n_out: Output features.
        num_experts: M.
        r: Rank of every expert.
        scaling: ``s`` (see :func:`rankwise.adapters.lora.lora_scale`).
        gate: Router logits -> expert weights; a module (e.g. :class:`TopKGate`) is registered
            as a submodule so its buffers follow ``.to()``.
        slots: Router outputs S.
        dropout: Dropout on the experts' input.
        device: Device of the expert weights.
        dtype: Dtype of the expert weights (the router is float32).
    """

    def __init__(self, n_in: int, n_out: int, num_experts: int, r: int, scaling: float, gate: Gate,
                 slots: int, dropout: float = 0.0, device=None, dtype=None) -> None:
        super().__init__()
        self.experts = nn.ModuleList(LoraExpert(n_in, n_out, r, device, dtype) for _ in range(num_experts))
        self.router = nn.Linear(n_in, slots, bias=False, device=device, dtype=torch.float32)
        nn.init.zeros_(self.router.weight)  # uniform routing at the start
        self.gate = gate
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling, self.r = scaling, r

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out + sum_m g(G x)_m * s * B_m A_m dropout(x)``."""
        w = self.gate(self.router(x.float()))                    # (..., M)
        a0 = self.experts[0].lora_A.weight
        h = self.dropout(x if x.dtype == a0.dtype else x.to(a0.dtype))
        for m, e in enumerate(self.experts):
            delta = F.linear(F.linear(h, e.lora_A.weight), e.lora_B.weight)  # (..., r) then (..., out)
            out = out + (w[..., m:m + 1] * delta * self.scaling).to(out.dtype)
        return out


class MixtureLoraLayer(nn.Module):
    """A linear-like layer with named mixtures of LoRA experts (``AdapterModule``).

    Args:
        base_layer: ``nn.Linear``, transformers' ``Conv1D``, or anything
            :func:`rankwise.core.weights.shape` reads; its weights are never modified.

    Attributes:
        mergeable: False: the routed sum depends on the input (see module docstring).
    """

    mergeable = False

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.out_features, self.in_features = W.shape(base_layer)
        self.mixtures = nn.ModuleDict()
        self.alphas: dict[str, float] = {}
        self.rslora: dict[str, bool] = {}
        self._active: list[str] = []

    # ----- construction -------------------------------------------------------------------
    def add(self, name: str, num_experts: int, r: int, alpha: float, gate: Gate | None = None,
            slots: int | None = None, dropout: float = 0.0, use_rslora: bool = False,
            init: str = "kaiming") -> LoraMixture:
        """Add mixture ``name`` and make it active.

        Args:
            name: Adapter name.
            num_experts: M >= 1.
            r: Rank of every expert, in [1, min(in, out)].
            alpha: LoRA alpha (scale ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA).
            gate: Router logits -> expert weights (default: dense softmax over M slots,
                ``TopKGate(list(range(M)), M)``).
            slots: Router outputs (default: ``gate.slots``, else M).
            dropout: Dropout on the experts' input.
            use_rslora: rsLoRA scale.
            init: Expert initialisation from ``rankwise.adapters.lora.LORA_INITS`` (B = 0: the
                mixture starts at the base layer's output).

        Returns:
            The new :class:`LoraMixture`.

        Raises:
            RankwiseError: On a bad rank, expert count or init name.
        """
        limit = min(self.in_features, self.out_features)
        if not 1 <= r <= limit:
            raise RankwiseError(f"rank {r} is invalid for a {self.in_features}->{self.out_features} "
                                f"layer; choose r in [1, {limit}]")
        if num_experts < 1:
            raise RankwiseError(f"num_experts: got {num_experts}; expected an integer >= 1")
        if init not in LORA_INITS:
            raise RankwiseError(f"unknown LoRA init {init!r}; expected one of {sorted(LORA_INITS)}")
        gate = gate if gate is not None else TopKGate(list(range(num_experts)), num_experts)
        slots = slots or getattr(gate, "slots", num_experts)
        w = W.dense_weight(self.base_layer)
        mix = LoraMixture(self.in_features, self.out_features, num_experts, r,
                          lora_scale(r, alpha, use_rslora), gate, slots, dropout, w.device, w.dtype)
        for e in mix.experts:
            LORA_INITS[init](e.lora_A, e.lora_B)
        self.mixtures[name] = mix
        self.alphas[name], self.rslora[name] = alpha, use_rslora
        if name not in self._active:
            self._active.append(name)
        return mix

    # ----- AdapterModule protocol -----------------------------------------------------------
    def adapter_names(self) -> list[str]:
        """Return the mixture names held by this layer."""
        return list(self.mixtures.keys())

    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """``{"experts.{m}.lora_A.weight", "experts.{m}.lora_B.weight", ..., "router.weight"}``."""
        mix = self.mixtures[name]
        out = {}
        for m, e in enumerate(mix.experts):
            out[f"experts.{m}.lora_A.weight"] = e.lora_A.weight
            out[f"experts.{m}.lora_B.weight"] = e.lora_B.weight
        out["router.weight"] = mix.router.weight
        return out

    def set_active(self, names: list[str]) -> None:
        """Use ``names`` in forward (unknown names are ignored; ``[]`` gives the base layer)."""
        self._active = [n for n in names if n in self.mixtures]

    def active_names(self) -> list[str]:
        """Return the active mixture names."""
        return list(self._active)

    def merge(self, name: str) -> None:
        """Refuse: a routed mixture has no input-independent weight delta.

        Raises:
            RankwiseError: Always (``rankwise.core.merge_adapters`` checks ``mergeable`` first).
        """
        raise RankwiseError(f"mixture adapter {name!r} cannot be merged into the base weight (its "
                            "experts are weighted per token by a router); keep it as an adapter")

    def unmerge(self) -> None:
        """Nothing is ever merged (a no-op, so ``disable_adapters`` works)."""

    def delete(self, name: str) -> None:
        """Remove mixture ``name``."""
        del self.mixtures[name]
        self.alphas.pop(name, None)
        self.rslora.pop(name, None)
        self._active = [n for n in self._active if n != name]

    def factors(self, name: str) -> None:
        """Protocol capability: a mixture has no single ``(A, B)`` pair, so ``None``; the
        experts' pairs are :meth:`expert_factors`."""
        return None

    def expert_factors(self, name: str, m: int) -> tuple[nn.Parameter, nn.Parameter]:
        """``(A_m (r, in), B_m (out, r))`` of expert ``m`` of mixture ``name``."""
        e = self.mixtures[name].experts[m]
        return e.lora_A.weight, e.lora_B.weight

    def router(self, name: str) -> nn.Linear:
        """The router ``G`` (S slots) of mixture ``name``."""
        return self.mixtures[name].router

    def num_experts(self, name: str) -> int:
        """M of mixture ``name``."""
        return len(self.mixtures[name].experts)

    def describe(self, name: str) -> dict[str, Any]:
        """Protocol capability: ``{"num_experts", "r", "alpha", "use_rslora", "slots", "gate"}``
        of mixture ``name`` (``gate`` is the gate's own ``describe()``, or its class name)."""
        mix = self.mixtures[name]
        gate = getattr(mix.gate, "describe", None)
        return {"num_experts": len(mix.experts), "r": mix.r, "alpha": self.alphas[name],
                "use_rslora": self.rslora[name], "slots": mix.router.out_features,
                "gate": gate() if callable(gate) else {"kind": type(mix.gate).__name__}}

    # ----- compute ------------------------------------------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        """The base weight as stored (so code that reads ``layer.weight`` keeps working)."""
        return W.storage_param(self.base_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``W0 x`` plus every active mixture's routed experts."""
        out = self.base_layer(x)
        for name in self._active:
            out = self.mixtures[name](x, out)
        return out

    def extra_repr(self) -> str:
        return ", ".join(f"{n}: M={len(m.experts)}, r={m.r}, slots={m.router.out_features}"
                         for n, m in self.mixtures.items())
