"""Gates (router logits -> expert weights), the switch balance loss, and router statistics.

Shared by every routed adapter: ``moe-lora``, FedLEASE's mixture, S'MoRE, LoPE, PT-MoE.

* :class:`TopKGate` - softmax over router slots, keep the ``k`` largest slot probabilities (not
  renormalised), sum the kept slots of each expert. One slot per expert is ordinary top-k
  routing; FedLEASE's adaptive top-M (Wang et al., NeurIPS 2025, Sec. 3.3) is this gate over
  its ``2M-1``-slot layout (:func:`own_expert_slots`), which is how FedLEASE gets a varying
  number of experts per token.
* :class:`ThresholdGate` - top-p routing: keep the fewest experts whose router probabilities
  reach ``threshold`` (at most ``max_k``), the dynamic routing of Huang et al. 2024 ("Harder
  Tasks Need More Experts: Dynamic Routing in MoE Models", p = ``threshold``), not
  renormalised. It is *not* FedLEASE's top-M; the paper pairs it with :func:`entropy_loss`.
* :func:`entropy_loss` - top-p routing's dynamic loss (router entropy, Huang et al. 2024).
* :func:`switch_balance_loss` - ``w * E * sum_e f_e * P_e`` (Switch Transformer, Fedus et al.
  2022, eq. 4; S'MoRE's switch gate uses the same sum with ``f_e`` counted over its top-f picks).
* :class:`RouterStats` - running expert load of one router, kept apart for training and
  evaluation forwards; adapter layers report it through the protocol's ``statistics``.
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


def _rows(t: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``t (..., E)`` as ``(N, E)`` rows, keeping only the rows where ``valid (...)`` is set."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if valid is None else rows[valid.reshape(-1).to(rows.device)]


def switch_balance_loss(probs: torch.Tensor, selected: torch.Tensor, weight: float,
                        valid: torch.Tensor | None = None) -> torch.Tensor:
    """Load-balancing loss ``weight * E * sum_e f_e * P_e`` (Switch Transformer eq. 4).

    ``f_e`` is the number of routing decisions that selected expert ``e`` divided by the number
    of decisions N (so ``sum_e f_e = k`` for top-k routing; S'MoRE's switch gate counts the same
    way), ``P_e`` the mean router probability of ``e``. Only ``P`` carries a gradient. At perfect
    balance with top-k the loss is ``weight * k``. Decisions on padding (``valid`` unset) are
    left out of both ``f`` and ``P``.

    Args:
        probs: Router probabilities ``(..., E)``.
        selected: Which experts each decision used ``(..., E)`` (bool or 0/1).
        weight: The coefficient (already part of the returned value).
        valid: Which decisions count, shaped like ``probs`` without its last axis (``None``:
            all; see :func:`rankwise.core.token_mask.valid_tokens`).

    Returns:
        A 0-dim float32 tensor (0 when no decision counts).
    """
    e = probs.shape[-1]
    p = _rows(probs, valid).float()
    if not p.shape[0]:
        return probs.float().sum() * 0.0
    f = _rows(selected, valid).float().detach().sum(0) / p.shape[0]
    return weight * e * (f * p.mean(0)).sum()


def entropy_loss(probs: torch.Tensor, weight: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Dynamic loss of top-p routing, ``weight * mean over decisions of -sum_e P_e log P_e``
    (Huang et al. 2024, "Harder Tasks Need More Experts", Sec. 3, the entropy of the router's
    distribution): without it a threshold router lowers its confidence to activate every
    expert; minimising the entropy keeps the distribution sharp.

    Args:
        probs: Router probabilities ``(..., E)``.
        weight: The coefficient (already part of the returned value).
        valid: Which decisions count (``None``: all), as in :func:`switch_balance_loss`.

    Returns:
        A 0-dim float32 tensor (0 when no decision counts).
    """
    p = _rows(probs, valid).float()
    if not p.shape[0]:
        return probs.float().sum() * 0.0
    return weight * -(p * p.clamp_min(1e-12).log()).sum(-1).mean()


class RouterStats:
    """Running expert load of one router, kept per mode (``train`` / ``eval`` forwards).

    Per mode it sums, over routing decisions (tokens, or examples for per-input routers): how
    often each expert was selected (weight > 0), how often it had the largest weight, and its
    gate weight. Sums live on the router's device and are read by :meth:`as_dict`.

    Args:
        num_experts: E.
    """

    MODES = ("train", "eval")

    def __init__(self, num_experts: int) -> None:
        self.num_experts = int(num_experts)
        self._sums: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def update(self, weights: torch.Tensor, training: bool, valid: torch.Tensor | None = None) -> None:
        """Add the decisions of one forward.

        Args:
            weights: Gate weights ``(..., E)`` (0 for experts not used).
            training: Whether the forward was a training forward.
            valid: Which decisions count, shaped like ``weights`` without its last axis
                (``None``: all); padding positions are left out.
        """
        w = _rows(weights.detach(), valid).float()
        top1 = torch.zeros_like(w).scatter(-1, w.argmax(-1, keepdim=True), 1.0)
        part = {"decisions": torch.tensor(float(w.shape[0]), device=w.device),
                "selected": (w > 0).float().sum(0), "top1": top1.sum(0), "weight": w.sum(0)}
        acc = self._sums.setdefault("train" if training else "eval", {})
        for key, value in part.items():
            acc[key] = acc[key] + value if key in acc else value

    def reset(self, modes: tuple[str, ...] = MODES) -> None:
        """Forget the sums of ``modes``."""
        for mode in modes:
            self._sums.pop(mode, None)

    def as_dict(self) -> dict[str, Any]:
        """``{"experts": E, mode: {"decisions", "selected", "top1", "weight", "load"}}``.

        ``selected``/``top1`` are fractions of decisions, ``weight`` the mean gate weight, and
        ``load`` each expert's share of the selections (of the gate weight for dense routers,
        where every expert is always selected); ``load`` sums to 1.
        """
        out: dict[str, Any] = {"experts": self.num_experts}
        for mode, acc in self._sums.items():
            n = max(float(acc["decisions"]), 1.0)
            sel, weight = acc["selected"].cpu(), acc["weight"].cpu()
            dense = bool((sel == sel.max()).all())
            share = weight if dense else sel
            out[mode] = {"decisions": int(n), "selected": (sel / n).tolist(),
                         "top1": (acc["top1"].cpu() / n).tolist(), "weight": (weight / n).tolist(),
                         "load": (share / share.sum().clamp_min(1e-12)).tolist()}
        return out
