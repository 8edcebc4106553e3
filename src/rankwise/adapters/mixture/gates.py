"""Gates (router logits -> expert weights) of the LoRA mixtures.

Used by ``moe-lora`` and FedLEASE's mixture; the balance and entropy losses and the router
statistics every routed adapter shares are in :mod:`rankwise.adapters.common.routing`.

* :class:`TopKGate` - softmax over router slots, keep the ``k`` largest slot probabilities (not
  renormalised), sum the kept slots of each expert. One slot per expert is ordinary top-k
  routing; FedLEASE's adaptive top-M (Wang et al., NeurIPS 2025, Sec. 3.3) is this gate over
  its ``2M-1``-slot layout (:func:`own_expert_slots`), which is how FedLEASE gets a varying
  number of experts per token.
* :class:`ThresholdGate` - top-p routing: keep the fewest experts whose router probabilities
  reach ``threshold`` (at most ``max_k``), the dynamic routing of Huang et al. 2024 ("Harder
  Tasks Need More Experts: Dynamic Routing in MoE Models", p = ``threshold``), not
  renormalised. It is *not* FedLEASE's top-M; the paper pairs it with
  :func:`rankwise.adapters.common.routing.entropy_loss`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


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

    def expert_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Router probability of each expert ``(..., M)`` (its slots' probabilities summed)."""
        return torch.softmax(logits.float(), dim=-1) @ self.slot_map

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        """Expert weights ``(..., M)`` from router logits ``(..., S)``."""
        probs = torch.softmax(logits.float(), dim=-1)                       # (..., S)
        top = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
        kept = torch.zeros_like(probs).scatter(-1, top.indices, top.values)  # (..., S)
        return kept @ self.slot_map                                         # (..., M)

    def describe(self) -> dict[str, Any]:
        """JSON structure that rebuilds this gate."""
        return {"kind": "top-k", "slot_experts": list(self.slot_experts), "top_k": self.top_k}


class ThresholdGate(nn.Module):
    """Top-p routing (Huang et al. 2024): the fewest experts whose probabilities sum to at
    least ``threshold``.

    Experts are ranked by router probability; expert ``e`` is kept when the mass of the experts
    ranked above it is below ``threshold`` and its rank is below ``max_k`` (so 1..max_k experts
    per token). Kept experts weigh by their router probability (no renormalisation, so the
    router keeps a gradient even when one expert is kept).

    Args:
        threshold: Cumulative probability mass p in (0, 1].
        max_k: Most experts per token.

    Raises:
        ValueError: On a threshold outside (0, 1] or ``max_k < 1``.
    """

    def __init__(self, threshold: float, max_k: int) -> None:
        super().__init__()
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold: got {threshold!r}; expected a value in (0, 1]")
        if max_k < 1:
            raise ValueError(f"max_k: got {max_k!r}; expected an integer >= 1")
        self.threshold, self.max_k = float(threshold), int(max_k)

    def expert_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Router probabilities ``(..., M)``."""
        return torch.softmax(logits.float(), dim=-1)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        """Expert weights ``(..., M)`` from router logits ``(..., M)``."""
        probs = torch.softmax(logits.float(), dim=-1)
        ranked, order = probs.sort(dim=-1, descending=True)
        above = ranked.cumsum(-1) - ranked                       # mass ranked above each expert
        rank = torch.arange(probs.shape[-1], device=probs.device)
        keep = (above < self.threshold) & (rank < self.max_k)    # (..., M) in ranked order
        mask = torch.zeros_like(probs).scatter(-1, order, keep.to(probs.dtype))
        return probs * mask

    def describe(self) -> dict[str, Any]:
        """JSON structure that rebuilds this gate."""
        return {"kind": "threshold", "threshold": self.threshold, "max_k": self.max_k}


def expert_probs(gate: Any, logits: torch.Tensor) -> torch.Tensor:
    """The router's probability per expert: ``gate.expert_probs`` if it has one, else softmax."""
    fn = getattr(gate, "expert_probs", None)
    return fn(logits) if callable(fn) else torch.softmax(logits.float(), dim=-1)
