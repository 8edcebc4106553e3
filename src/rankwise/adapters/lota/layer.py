"""The LoTA-QAF layer: ternary adapters that move a quantized base along its integer grid.

Lossless ternary adaptation (LoTA-QAF, arXiv 2505.18724, Sec. 3; the authors'
``CustomLoraLinear.forward`` and ``LTA.merge``), in rankwise's ``(out, in)`` layout. The base
is a :class:`~rankwise.adapters.lota.quant.QuantLinear` with codes ``q``, scales ``s`` and zero
points ``z`` per group ``g`` of input columns. An adapter holds ternary ``A (r, in)`` and
``B (out, r)`` (float tensors with values in ``{-1, 0, 1}``), so ``Delta = B A`` is an integer
matrix in ``[-r, r]``. With ``omega = threshold_ratio * r``::

    m  = +1 where Delta >  omega and q < 2^b - 1      (the grid masks: q + m stays on the grid)
         -1 where Delta < -omega and q > 0
          0 otherwise
    R  = Delta - omega m                                (the residual)
    zp = mean_{i in group} R[:, i] / omega              (the offset factor, per row and group)
    W' = s ((q - z) + m + zp)                           (the whole layer weight)

Backward is straight-through for the threshold (``dm / dDelta := 1``); gradients also reach
``Delta`` through ``zp``. ``A`` starts ternarized from a Kaiming-normal draw (``+1`` above
``0.75 mean |a|``, ``-1`` below its negative), ``B`` at zero, so the adapted layer starts as the
quantized base.

Merge is integer arithmetic: ``q <- q + m`` (bit-exact, every code stays in ``[0, 2^b - 1]``).
The offset factor is the one term the integer grid cannot hold. With ``fold_offsets`` (default)
it is folded into the zero point, ``z <- z - zp`` (a float zero point, so the merged output
equals the adapted output up to rounding); without it the zero points stay integers and the
merged weight differs from the adapted one by exactly ``-s zp`` per row and group - the
"offset-factor term" the authors store separately as ``new_zero_factors``.
"""
from __future__ import annotations


import torch
from torch import nn
from torch.nn import functional as F

from rankwise.adapters.lota.quant import QuantLinear
from rankwise.core.protocol import NamedAdapters
from rankwise.errors import RankwiseError


def ternarize(w: torch.Tensor) -> torch.Tensor:
    """``+1`` where ``w > delta``, ``-1`` where ``w < -delta``, else 0, with
    ``delta = 0.75 mean |w|`` (the authors' ``IntLinear`` initialisation)."""
    delta = 0.75 * w.abs().mean()
    return torch.where(w > delta, 1.0, torch.where(w < -delta, -1.0, 0.0)).to(w.dtype)


class LotaLayer(NamedAdapters, nn.Module):
    """A quantized linear layer with named ternary adapters (``AdapterModule``).

    Attributes:
        ternary: Capability read by ``t-signsgd``: this layer's adapter tensors are ternary.
        mergeable: True: merging moves the integer codes (see the module docstring).
        merges_on_grid: True: the merge is integer arithmetic on the quantized base itself, so
            a merged export merges first and dequantizes after.

    Args:
        base_layer: The :class:`QuantLinear` base.
        fold_offsets: On merge, fold offset factors into the zero points (see module docstring).

    Raises:
        RankwiseError: If ``base_layer`` is not a :class:`QuantLinear`.
    """

    adapters_attr = "lota_A"

    ternary = True
    mergeable = True
    merges_on_grid = True

    def __init__(self, base_layer: nn.Module, fold_offsets: bool = True) -> None:
        super().__init__()
        if not isinstance(base_layer, QuantLinear):
            raise RankwiseError(f"LoTA-QAF adapts rankwise's integer-grid layers, got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.fold_offsets = fold_offsets
        self.lota_A = nn.ParameterDict()
        self.lota_B = nn.ParameterDict()
        self.omegas: dict[str, float] = {}
        self._active: list[str] = []
        self._merged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # ----- construction -------------------------------------------------------------------
    def add(self, name: str, r: int, threshold_ratio: float = 0.75) -> None:
        """Add ternary adapter ``name`` of rank ``r`` and make it active.

        Args:
            name: Adapter name.
            r: Rank of ``A (r, in)`` and ``B (out, r)``.
            threshold_ratio: ``omega = threshold_ratio * r``.
        """
        base = self.base_layer
        a = torch.empty(r, base.in_features, device=base.weight.device)
        nn.init.kaiming_normal_(a)
        self.lota_A[name] = nn.Parameter(ternarize(a))                            # (r, in)
        self.lota_B[name] = nn.Parameter(torch.zeros(base.out_features, r, device=base.weight.device))
        self.omegas[name] = threshold_ratio * r
        if name not in self._active:
            self._active.append(name)

    # ----- AdapterModule protocol -----------------------------------------------------------
    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """``{"lota_A": A (r, in), "lota_B": B (out, r)}`` of adapter ``name``."""
        return {"lota_A": self.lota_A[name], "lota_B": self.lota_B[name]}

    def describe(self, name: str) -> dict:
        """Protocol capability: ``{"r", "threshold_ratio"}`` of adapter ``name``."""
        r = int(self.lota_A[name].shape[0])
        return {"r": r, "threshold_ratio": self.omegas[name] / r}

    # ----- the grid arithmetic ------------------------------------------------------------
    def grid_step(self, name: str, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m, zp)`` of adapter ``name`` against ``codes``: ``m`` (float, ``-1/0/1`` values,
        straight-through to ``Delta``) ``(out, in)`` and the offset factors ``(out, groups)``."""
        base, omega = self.base_layer, self.omegas[name]
        delta = self.lota_B[name] @ self.lota_A[name]                       # (out, in), integers
        up = (delta.detach() > omega) & (codes < base.maxq)
        down = (delta.detach() < -omega) & (codes > 0)
        hard = up.to(delta.dtype) - down.to(delta.dtype)
        m = hard + (delta - delta.detach())                                 # straight-through
        zp = base.grouped(delta - omega * hard).mean(-1) / omega            # (out, groups)
        return m, zp

    def adapted_weight(self) -> torch.Tensor:
        """``s ((q - z) + sum_active (m + zp))`` as ``(out, in)`` (merged adapters are in q, z)."""
        base = self.base_layer
        codes = base.codes()
        q = codes.float()
        extra = torch.zeros_like(q)
        offsets = torch.zeros_like(base.zeros)
        for name in self._active:
            if name in self._merged:
                continue
            m, zp = self.grid_step(name, codes)
            extra = extra + m
            offsets = offsets + zp
            codes = (codes.int() + m.detach().round().int()).to(torch.uint8)  # next adapter's masks
        w = base.scales.unsqueeze(-1) * (base.grouped(q + extra) - base.zeros.unsqueeze(-1) + offsets.unsqueeze(-1))
        return w.reshape(base.out_features, base.in_features)

    def merge(self, name: str) -> None:
        """``q <- q + m`` (integer, stays on the grid) and, with ``fold_offsets``, ``z <- z - zp``."""
        if name in self._merged:
            return
        base = self.base_layer
        with torch.no_grad():
            codes = base.codes()
            m, zp = self.grid_step(name, codes)
            step = m.round().to(torch.int16)
            base.set_codes((codes.to(torch.int16) + step).to(torch.uint8))
            zp = zp if self.fold_offsets else torch.zeros_like(zp)
            base.zeros.sub_(zp)
        self._merged[name] = (step.to(torch.int8), zp)

    def unmerge(self) -> None:
        """Undo every merge, newest first (codes and zero points restored exactly)."""
        base = self.base_layer
        for name in reversed(list(self._merged)):
            step, zp = self._merged.pop(name)
            with torch.no_grad():
                base.set_codes((base.codes().to(torch.int16) - step).to(torch.uint8))
                base.zeros.add_(zp)

    def delete(self, name: str) -> None:
        """Remove adapter ``name`` (unmerging first if needed)."""
        if name in self._merged:
            self.unmerge()
        del self.lota_A[name], self.lota_B[name]
        self.omegas.pop(name, None)
        self._forget(name)

    # ----- compute ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W'^T + b`` with the adapted weight (the base forward when nothing is pending)."""
        if not any(n not in self._merged for n in self._active):
            return self.base_layer(x)
        w = self.adapted_weight()
        bias = self.base_layer.bias
        return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def extra_repr(self) -> str:
        return ", ".join(f"{n}: r={self.lota_A[n].shape[0]}, omega={self.omegas[n]:g}"
                         for n in self.adapter_names())


def weight_bytes(layer: QuantLinear) -> int:
    """Bytes of a quantized layer's storage: packed codes, scales, zero points (and bias)."""
    return sum(t.numel() * t.element_size() for t in (layer.weight, layer.scales, layer.zeros)
               + ((layer.bias,) if layer.bias is not None else ()))


