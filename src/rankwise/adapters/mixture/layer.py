"""A mixture of LoRA experts behind a router (an ``AdapterModule``): ``moe-lora`` and FedLEASE.

For one named adapter with experts ``m = 0..M-1`` (each a LoRA pair ``A_m (r, in)``,
``B_m (out, r)``), a router ``G (S, in)`` with ``S`` slots and a *gate* ``g`` that turns the
router logits into per-expert weights (the token-level mixture of LoRA experts of MoLA /
MixLoRA; HAWAII's MoLA routers are this layer with one router per expert group)::

    y = W0 x + sum_m g(G x)_m * s * B_m A_m x          # g(G x): (..., M)

The router reads the layer input, so the weights change per token: the adapter cannot be
folded into ``W0`` (``mergeable = False``; :func:`rankwise.core.merge_adapters` refuses it).
With ``B_m = 0`` at initialisation the layer starts at the base layer's output.

Gates live in :mod:`rankwise.adapters.mixture.gates`: :class:`TopKGate` (fixed top-k, and
FedLEASE's adaptive top-M as a ``2M-1``-slot layout, Wang et al., NeurIPS 2025, Sec. 3.3) and
``ThresholdGate`` (top-p routing by cumulative router mass, Huang et al. 2024). A mixture with
``balance_weight > 0`` reports the switch balance loss, one with ``entropy_weight > 0`` top-p
routing's dynamic (router entropy) loss, through the protocol's ``aux_losses`` in training
forwards; every mixture counts its expert load (``statistics``). Both the losses and the load
count real tokens only: the model's attention mask reaches the mixture through
:func:`rankwise.core.token_mask.track_token_mask` (``token_mask``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.adapters.common.factors import LORA_INITS, check_rank, lora_scale
from rankwise.adapters.common.layers import UnmergeableLayer
from rankwise.adapters.common.routing import RouterStats, entropy_loss, switch_balance_loss
from rankwise.adapters.mixture.gates import TopKGate, expert_probs, own_expert_slots
from rankwise.core import weights as layer_weights
from rankwise.core.token_mask import valid_tokens
from rankwise.errors import RankwiseError

__all__ = ["Gate", "LoraExpert", "LoraMixture", "MixtureLoraLayer", "TopKGate", "own_expert_slots"]

Gate = Callable[[torch.Tensor], torch.Tensor]  # router logits (..., S) -> expert weights (..., M)


class LoraExpert(nn.Module):
    """One expert: a LoRA pair (``lora_A``: in -> r, ``lora_B``: r -> out), bias-free, float32
    (the master weights, whatever the base's dtype)."""

    def __init__(self, n_in: int, n_out: int, r: int, device=None) -> None:
        super().__init__()
        self.lora_A = nn.Linear(n_in, r, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(r, n_out, bias=False, device=device, dtype=torch.float32)


ROUTER_INITS = ("zeros", "kaiming")


class LoraMixture(nn.Module):
    """One named adapter of a :class:`MixtureLoraLayer`: experts, router, gate, scale.

    Args:
        n_in: Input features of the adapted layer.
        n_out: Output features.
        num_experts: M.
        r: Rank of every expert.
        scaling: ``s`` (see :func:`rankwise.adapters.common.factors.lora_scale`).
        gate: Router logits -> expert weights; a module (e.g. :class:`TopKGate`) is registered
            as a submodule so its buffers follow ``.to()``.
        slots: Router outputs S.
        dropout: Dropout on the experts' input.
        device: Device of the weights (experts and router are float32).
        router_init: ``zeros`` (uniform routing at the start; FedLEASE) or ``kaiming``
            (``nn.Linear``'s default: tokens spread over experts from the first step).
        balance_weight: Coefficient of the switch balance loss (0 = none).
        entropy_weight: Coefficient of the router-entropy (dynamic) loss (0 = none).

    Attributes:
        last_aux: ``{"balance_loss", "dynamic_loss"}`` of the last training forward (the
            enabled ones; else empty).
        stats: The :class:`RouterStats` of this mixture.
        token_mask: The attention mask of the current forward (set by the model's hook), so
            padded positions stay out of the losses and the load.
    """

    def __init__(self, n_in: int, n_out: int, num_experts: int, r: int, scaling: float, gate: Gate,
                 slots: int, dropout: float = 0.0, device=None, router_init: str = "zeros",
                 balance_weight: float = 0.0, entropy_weight: float = 0.0) -> None:
        super().__init__()
        self.experts = nn.ModuleList(LoraExpert(n_in, n_out, r, device) for _ in range(num_experts))
        self.router = nn.Linear(n_in, slots, bias=False, device=device, dtype=torch.float32)
        if router_init == "zeros":
            nn.init.zeros_(self.router.weight)
        self.gate = gate
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling, self.r, self.balance_weight = scaling, r, float(balance_weight)
        self.entropy_weight = float(entropy_weight)
        self.last_aux: dict[str, torch.Tensor] = {}
        self.stats = RouterStats(num_experts)
        self.token_mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out + sum_m g(G x)_m * s * B_m A_m dropout(x)``."""
        logits = self.router(x.float())                           # (..., S)
        w = self.gate(logits)                                     # (..., M)
        valid = valid_tokens(self.token_mask, x.shape[:-1])       # (...) real tokens, or None
        self.last_aux = {}
        if self.training and self.balance_weight > 0:
            self.last_aux["balance_loss"] = switch_balance_loss(
                expert_probs(self.gate, logits), w > 0, self.balance_weight, valid)
        if self.training and self.entropy_weight > 0:
            self.last_aux["dynamic_loss"] = entropy_loss(expert_probs(self.gate, logits),
                                                         self.entropy_weight, valid)
        self.stats.update(w, self.training, valid)
        h = self.dropout(x if x.dtype == torch.float32 else x.float())
        # sum_m w_m B_m A_m h as one product over the stacked experts: [B_0 .. B_M-1] (w_m A_m h)_m
        a = torch.cat([e.lora_A.weight for e in self.experts], dim=0)          # (M r, in)
        b = torch.cat([e.lora_B.weight for e in self.experts], dim=1)          # (out, M r)
        low = F.linear(h, a) * w.repeat_interleave(self.r, dim=-1)             # (..., M r)
        return out + (F.linear(low, b) * self.scaling).to(out.dtype)           # (..., out)


class MixtureLoraLayer(UnmergeableLayer):
    """A linear-like layer with named mixtures of LoRA experts (``AdapterModule``).

    Args:
        base_layer: ``nn.Linear``, transformers' ``Conv1D``, or anything
            :func:`rankwise.core.weights.shape` reads; its weights are never modified.

    Attributes:
        mergeable: False: the routed sum depends on the input (see module docstring).
    """

    adapters_attr = "mixtures"
    adapter_kind = "mixture"
    unmergeable_reason = ("its experts are weighted per token by a router; keep it as an adapter: "
                          "export with --format rankwise")

    # ----- construction -------------------------------------------------------------------
    def add(self, name: str, num_experts: int, r: int, alpha: float, gate: Gate | None = None,
            slots: int | None = None, dropout: float = 0.0, use_rslora: bool = False,
            init: str = "kaiming", router_init: str = "zeros",
            balance_weight: float = 0.0, entropy_weight: float = 0.0) -> LoraMixture:
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
            init: Expert initialisation from ``rankwise.adapters.common.factors.LORA_INITS`` (B = 0: the
                mixture starts at the base layer's output).
            router_init: ``zeros`` or ``kaiming`` (see :class:`LoraMixture`).
            balance_weight: Switch balance-loss coefficient (0 = none).
            entropy_weight: Router-entropy (dynamic) loss coefficient (0 = none).

        Returns:
            The new :class:`LoraMixture`.

        Raises:
            RankwiseError: On a bad rank, expert count, init or router init name.
        """
        check_rank(r, self.in_features, self.out_features)
        if num_experts < 1:
            raise RankwiseError(f"num_experts: got {num_experts}; expected an integer >= 1")
        if init not in LORA_INITS:
            raise RankwiseError(f"unknown LoRA init {init!r}; expected one of {sorted(LORA_INITS)}")
        if router_init not in ROUTER_INITS:
            raise RankwiseError(f"router init: got {router_init!r}; expected one of {list(ROUTER_INITS)}")
        gate = gate if gate is not None else TopKGate(list(range(num_experts)), num_experts)
        slots = slots or getattr(gate, "slots", num_experts)
        device = next(self.base_layer.parameters()).device
        mix = LoraMixture(self.in_features, self.out_features, num_experts, r,
                          lora_scale(r, alpha, use_rslora), gate, slots, dropout, device,
                          router_init, balance_weight, entropy_weight)
        for e in mix.experts:
            LORA_INITS[init](e.lora_A, e.lora_B)
        return self.hold(name, mix, {"alpha": alpha, "use_rslora": use_rslora})

    # ----- AdapterModule protocol -----------------------------------------------------------
    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """``{"experts.{m}.lora_A.weight", "experts.{m}.lora_B.weight", ..., "router.weight"}``."""
        mix = self.mixtures[name]
        out = {}
        for m, e in enumerate(mix.experts):
            out[f"experts.{m}.lora_A.weight"] = e.lora_A.weight
            out[f"experts.{m}.lora_B.weight"] = e.lora_B.weight
        out["router.weight"] = mix.router.weight
        return out

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
        return {"num_experts": len(mix.experts), "r": mix.r, "alpha": self.settings[name]["alpha"],
                "use_rslora": self.settings[name]["use_rslora"], "slots": mix.router.out_features,
                "gate": gate() if callable(gate) else {"kind": type(mix.gate).__name__}}

    def statistics(self) -> dict[str, Any]:
        """Protocol capability: ``{mixture name: RouterStats.as_dict()}`` (expert load)."""
        return {n: m.stats.as_dict() for n, m in self.mixtures.items()}

    def reset_statistics(self, modes: tuple[str, ...] = RouterStats.MODES) -> None:
        """Protocol capability: forget the expert-load sums of ``modes``."""
        for m in self.mixtures.values():
            m.stats.reset(modes)

    # ----- compute ------------------------------------------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        """The base weight as stored (so code that reads ``layer.weight`` keeps working)."""
        return layer_weights.storage_param(self.base_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``W0 x`` plus every active mixture's routed experts."""
        out = self.base_layer(x)
        self._aux = {}
        for name in self._active:
            mix = self.mixtures[name]
            out = mix(x, out)
            self.add_aux(mix.last_aux)  # the balance loss (training forwards)
        return out

    def extra_repr(self) -> str:
        return ", ".join(f"{n}: M={len(m.experts)}, r={m.r}, slots={m.router.out_features}"
                         for n, m in self.mixtures.items())
