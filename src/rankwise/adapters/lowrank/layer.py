"""A linear layer with a factorized low-rank part ``U S V^T`` (an ``AdapterModule``).

Two modes (per adapter; a layer holds one ``factorized`` adapter or any number of ``adapter``
ones):

* ``adapter``: ``y = W0 x + U S V^T x`` (+ bias), ``W0`` frozen. ``U`` (out x r) and ``V``
  (in x r) start as random orthonormal bases and ``S`` (r x r) at zero, so the output is the
  base model's; merge adds ``U S V^T`` to ``W0`` exactly. This is the parametrization of
  dynamical-low-rank fine-tuning (GeoLoRA; Schotthoefer, Klein, Kusch 2025).
* ``factorized``: ``y = U S V^T x`` (+ the base bias): the dense weight is replaced by its
  truncated SVD and *released* - the base layer keeps a zero-stride zero matrix of the same
  logical shape, so no memory is spent on it and the model's fingerprint is unchanged. A
  factorized layer is a different kind of object than an adapter: there is no separate base
  weight to fall back to. The protocol still holds with ``W0 := 0``: disabling gives ``bias``
  only, ``merge`` materializes ``U S V^T`` as a dense weight (the merged export is a plain dense
  model) and ``unmerge`` releases it again.

The factors are float32 (master weights) whatever the base dtype; ``lowrank_factors(name)``
exposes ``(U, S, V)`` to the geometric optimizers (``lowrank-hb``, ``lowrank-adam``).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.core import weights as layer_weights
from rankwise.core.protocol import NamedAdapters
from rankwise.errors import RankwiseError

MODES = ("adapter", "factorized")


def released_weight(out_features: int, in_features: int, like: torch.Tensor) -> nn.Parameter:
    """A frozen zero matrix of logical shape ``(out, in)`` that holds one element of memory
    (a zero-stride view), standing in for a released dense weight."""
    zero = torch.zeros(1, dtype=like.dtype, device=like.device).expand(out_features, in_features)
    return nn.Parameter(zero, requires_grad=False)


class LowRankLayer(NamedAdapters, nn.Module):
    """Named low-rank factorizations ``U S V^T`` on a linear layer (see the module docstring).

    Args:
        base_layer: ``nn.Linear`` or transformers' ``Conv1D``.

    Raises:
        RankwiseError: If ``base_layer`` is not linear-like or is quantized.
    """

    adapters_attr = "lowrank_U"

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        if layer_weights.is_quantized(base_layer) or not hasattr(base_layer, "weight"):
            raise RankwiseError(f"lowrank needs a dense nn.Linear or Conv1D, got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.out_features, self.in_features = layer_weights.shape(base_layer)
        self.lowrank_U = nn.ParameterDict()
        self.lowrank_S = nn.ParameterDict()
        self.lowrank_V = nn.ParameterDict()
        self.modes: dict[str, str] = {}
        self._active: list[str] = []
        self._merged: list[str] = []

    # ----- construction -------------------------------------------------------------------
    def add(self, name: str, rank: int, mode: str = "adapter") -> None:
        """Add factorization ``name`` of rank ``rank`` and make it active.

        Args:
            name: Factorization name.
            rank: ``r``, at most ``min(in, out)``.
            mode: ``adapter`` (``W0 + U S V^T``, ``S = 0``) or ``factorized`` (the truncated SVD
                of the weight replaces it; see the module docstring).

        Raises:
            RankwiseError: If the rank exceeds ``min(in, out)``, the mode is unknown, or a
                second adapter is added beside a ``factorized`` one.
        """
        limit = min(self.in_features, self.out_features)
        if not 1 <= rank <= limit:
            raise RankwiseError(f"lowrank rank {rank} is larger than the {self.in_features}->"
                                f"{self.out_features} layer allows; choose rank in [1, {limit}]")
        if mode not in MODES:
            raise RankwiseError(f"lowrank mode: got {mode!r}; expected one of {list(MODES)}")
        if "factorized" in self.modes.values() or (mode == "factorized" and self.modes):
            raise RankwiseError("a factorized low-rank layer holds exactly one factorization; "
                                "use mode: adapter for several named adapters")
        dense = layer_weights.dense_weight(self.base_layer).detach().float()          # (out, in)
        if mode == "factorized":
            u, s, vh = torch.linalg.svd(dense, full_matrices=False)
            u, s, v = u[:, :rank], torch.diag(s[:rank]), vh[:rank].T
            base = layer_weights.base_layer(self.base_layer)
            base.weight = released_weight(*base.weight.shape, base.weight)
        else:
            gen_dev = dense.device
            u = torch.linalg.qr(torch.randn(self.out_features, rank, device=gen_dev))[0]
            v = torch.linalg.qr(torch.randn(self.in_features, rank, device=gen_dev))[0]
            s = torch.zeros(rank, rank, device=gen_dev)
        self.lowrank_U[name] = nn.Parameter(u.contiguous())              # (out, r)
        self.lowrank_S[name] = nn.Parameter(s.contiguous())              # (r, r)
        self.lowrank_V[name] = nn.Parameter(v.contiguous())              # (in, r)
        self.modes[name] = mode
        if name not in self._active:
            self._active.append(name)

    # ----- AdapterModule protocol -----------------------------------------------------------
    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """``{"lowrank_U", "lowrank_S", "lowrank_V"}`` of factorization ``name``."""
        return {"lowrank_U": self.lowrank_U[name], "lowrank_S": self.lowrank_S[name],
                "lowrank_V": self.lowrank_V[name]}

    def lowrank_factors(self, name: str) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
        """Capability read by the geometric optimizers: ``(U (out, r), S (r, r), V (in, r))``."""
        return self.lowrank_U[name], self.lowrank_S[name], self.lowrank_V[name]

    def describe(self, name: str) -> dict:
        """Protocol capability: ``{"rank", "mode"}`` of factorization ``name``."""
        return {"rank": int(self.lowrank_S[name].shape[0]), "mode": self.modes[name]}

    def delta_weight(self, name: str) -> torch.Tensor:
        """``U S V^T`` as ``(out, in)``, float32."""
        u, s, v = self.lowrank_factors(name)
        return (u.float() @ s.float()) @ v.float().T

    def merge(self, name: str) -> None:
        """``adapter``: ``W0 += U S V^T``; ``factorized``: materialize ``U S V^T`` as the dense
        weight (skips a factorization that is already merged)."""
        if name in self._merged:
            return
        base = layer_weights.base_layer(self.base_layer)
        delta = layer_weights.to_storage_layout(self.base_layer, self.delta_weight(name))
        with torch.no_grad():
            if self.modes[name] == "factorized":
                base.weight = nn.Parameter(delta.to(base.weight.dtype).contiguous(), requires_grad=False)
            else:
                w = base.weight
                w.copy_((w.float() + delta).to(w.dtype))
        self._merged.append(name)

    def unmerge(self) -> None:
        """Undo every merge, newest first (a factorized layer releases its dense weight again)."""
        base = layer_weights.base_layer(self.base_layer)
        while self._merged:
            name = self._merged.pop()
            if self.modes[name] == "factorized":
                base.weight = released_weight(*base.weight.shape, base.weight)
                continue
            delta = layer_weights.to_storage_layout(self.base_layer, self.delta_weight(name))
            with torch.no_grad():
                base.weight.copy_((base.weight.float() - delta).to(base.weight.dtype))

    def delete(self, name: str) -> None:
        """Remove factorization ``name`` (unmerging first if needed)."""
        if name in self._merged:
            self.unmerge()
        for d in (self.lowrank_U, self.lowrank_S, self.lowrank_V):
            del d[name]
        self.modes.pop(name, None)
        self._forget(name)

    # ----- compute ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``base(x) + sum_active ((x V) S^T) U^T``; a factorized layer's base weight is zero, so
        only its bias enters (merged factorizations are already in the base weight)."""
        pending = [n for n in self._active if n not in self._merged]
        base = layer_weights.base_layer(self.base_layer)
        if any(self.modes[n] == "factorized" for n in pending):
            bias = getattr(base, "bias", None)
            out = None if bias is None else bias.to(x.dtype)
        else:
            out = self.base_layer(x)
        for name in pending:
            u, s, v = self.lowrank_factors(name)
            h = x if x.dtype == u.dtype else x.to(u.dtype)
            delta = F.linear(F.linear(F.linear(h, v.T), s), u)      # (..., r), (..., r), (..., out)
            delta = delta if out is None or delta.dtype == out.dtype else delta.to(out.dtype)
            out = delta if out is None else out + delta
        return out

    def extra_repr(self) -> str:
        return ", ".join(f"{n}: r={self.lowrank_S[n].shape[0]}, {self.modes[n]}" for n in self.adapter_names())
