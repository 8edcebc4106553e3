"""What every routed adapter shares: the switch balance loss, top-p routing's entropy loss and
router statistics, each counting real tokens only when given the valid positions.

Used by ``moe-lora`` and FedLEASE's mixture, S'MoRE, LoPE and PT-MoE.

* :func:`entropy_loss` - top-p routing's dynamic loss (router entropy, Huang et al. 2024).
* :func:`switch_balance_loss` - ``w * E * sum_e f_e * P_e`` (Switch Transformer, Fedus et al.
  2022, eq. 4; S'MoRE's switch gate uses the same sum with ``f_e`` counted over its top-f picks).
* :class:`RouterStats` - running expert load of one router, kept apart for training and
  evaluation forwards; adapter layers report it through the protocol's ``statistics``.
"""
from __future__ import annotations

from typing import Any

import torch


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
