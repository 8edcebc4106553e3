"""rankwise's own integer-grid base: b-bit, asymmetric, group-wise (GPTQ's storage format),
rounded to nearest.

``W ~ s_g (q - z_g)`` with integer codes ``q in [0, 2^b - 1]``, one scale ``s`` and zero point
``z`` per output row and group of ``group_size`` input columns. The range of each group is
``[min(w, 0), max(w, 0)]`` (GPTQ's ``Quantizer.find_params``), ``s = range / (2^b - 1)``,
``z = round(-min / s)``, ``q = clamp(round(w / s) + z, 0, 2^b - 1)``. GPTQ proper also chooses
the codes column by column with second-order error feedback from calibration data; we round to
nearest (RTN) - the format, not the rounding, is what LoTA-QAF needs, and the comparisons run
every method on the same RTN base. Zero points start as integers; merging LoTA-QAF's offset
factors makes them fractional (see :mod:`rankwise.adapters.lota.layer`).

:class:`QuantLinear` registers its dequantizer with :mod:`rankwise.core.weights`, so the rest of
rankwise (fingerprints, ``dense_weight``, a LoRA on top of it, the merged export) reads it as a
linear layer of its logical shape.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.core import weights as layer_weights
from rankwise.errors import RankwiseError


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise round-to-nearest quantization of an ``(out, in)`` weight.

    Args:
        w: The weight.
        bits: Grid bits ``b``.
        group_size: Columns per group; must divide ``in``.

    Returns:
        ``(codes uint8 (out, in), scales (out, in / g), zeros (out, in / g))``, float32.
    """
    maxq = 2 ** bits - 1
    out_f, in_f = w.shape
    wg = w.detach().float().reshape(out_f, in_f // group_size, group_size)   # (out, G, g)
    lo = wg.amin(-1).clamp(max=0)
    hi = wg.amax(-1).clamp(min=0)
    scale = (hi - lo) / maxq
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)
    codes = torch.clamp(torch.round(wg / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, maxq)
    return codes.reshape(out_f, in_f).to(torch.uint8), scale, zero


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``(out, in)`` codes ``< 2^bits`` into ``(out, in * bits / 8)`` bytes, low bits first."""
    per = 8 // bits
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, per)               # (out, in/per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.uint8) * bits
    return (c << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``(out, in)`` uint8 codes."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
    return ((packed.unsqueeze(-1) >> shifts) & (2 ** bits - 1)).reshape(packed.shape[0], -1)


class QuantLinear(nn.Linear):
    """A linear layer stored on a b-bit asymmetric group-wise integer grid.

    ``weight`` is the packed code matrix (a frozen uint8 parameter, so the model's fingerprint
    sees the layer); ``scales`` and ``zeros`` are float32 buffers ``(out, in / group_size)``.
    The forward dequantizes: ``y = x (s (q - z))^T + b``.

    Args:
        in_features: Input width.
        out_features: Output width.
        bits: 2, 4 or 8.
        group_size: Input columns per group (divides ``in_features``).
        bias: Whether the layer has a bias.
        device: Where the storage lives.
        dtype: Compute dtype of the dequantized weight and of the bias.
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int,
                 bias: bool = True, device=None, dtype=torch.float32) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.compute_dtype = bits, group_size, dtype
        groups = in_features // group_size
        self.weight = nn.Parameter(torch.zeros(out_features, in_features * bits // 8, dtype=torch.uint8,
                                               device=device), requires_grad=False)
        self.register_buffer("scales", torch.ones(out_features, groups, device=device))
        self.register_buffer("zeros", torch.zeros(out_features, groups, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, layer: nn.Module, bits: int, group_size: int) -> "QuantLinear":
        """Quantize a dense ``nn.Linear`` or ``Conv1D`` (round to nearest; see the module docstring).

        Raises:
            RankwiseError: If ``group_size`` does not divide the input size.
        """
        out_f, in_f = layer_weights.shape(layer)
        if in_f % group_size:
            raise RankwiseError(f"group size {group_size} does not divide the input size {in_f} of "
                                f"{type(layer).__name__}; choose a group_size that divides it")
        if in_f % (8 // bits):
            raise RankwiseError(f"{bits}-bit codes pack {8 // bits} per byte, which does not divide "
                                f"the input size {in_f}; use bits: 8")
        dense = layer_weights.dense_weight(layer).detach()
        bias = getattr(layer, "bias", None)
        new = cls(in_f, out_f, bits, group_size, bias is not None, dense.device, dense.dtype)
        codes, scale, zero = rtn_quantize(dense, bits, group_size)
        with torch.no_grad():
            new.weight.copy_(pack(codes, bits))
            new.scales.copy_(scale)
            new.zeros.copy_(zero)
            if bias is not None:
                new.bias.copy_(bias.detach())
        if new.bias is not None:
            new.bias.requires_grad_(False)
        return new

    @property
    def maxq(self) -> int:
        """The largest code, ``2^bits - 1``."""
        return 2 ** self.bits - 1

    def codes(self) -> torch.Tensor:
        """The ``(out, in)`` uint8 codes."""
        return unpack(self.weight, self.bits)

    def set_codes(self, codes: torch.Tensor) -> None:
        """Store ``(out, in)`` codes (each in ``[0, maxq]``)."""
        assert int(codes.min()) >= 0 and int(codes.max()) <= self.maxq, "codes left the grid"
        with torch.no_grad():
            self.weight.copy_(pack(codes, self.bits))

    def grouped(self, t: torch.Tensor) -> torch.Tensor:
        """View an ``(out, in)`` tensor as ``(out, groups, group_size)``."""
        return t.reshape(self.out_features, -1, self.group_size)

    def dequantize(self) -> torch.Tensor:
        """The dense ``(out, in)`` weight ``s (q - z)`` in the compute dtype."""
        q = self.grouped(self.codes().float())
        w = self.scales.unsqueeze(-1) * (q - self.zeros.unsqueeze(-1))
        return w.reshape(self.out_features, self.in_features).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (s (q - z))^T + b``."""
        w = self.dequantize()
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


layer_weights.DEQUANTIZERS[QuantLinear] = QuantLinear.dequantize


def quantize_linears(model: nn.Module, targets, bits: int, group_size: int) -> dict[str, QuantLinear]:
    """Replace the selected linear layers of ``model`` by RTN :class:`QuantLinear` layers (the
    base for LoRA-on-a-4-bit-base comparisons; ``lota-qaf`` does this itself).

    Args:
        model: The model (changed in place).
        targets: The target language of :func:`rankwise.core.inject.find_targets`.
        bits: Grid bits.
        group_size: Columns per group (capped at each layer's input size).

    Returns:
        ``{path: QuantLinear}``.

    Raises:
        RankwiseError: If the group size does not divide a layer's input size.
    """
    from rankwise.core.inject import find_targets, inject
    paths = find_targets(model, targets, None, "targets")
    return inject(model, paths, lambda _, m: QuantLinear.from_linear(m, bits, min(group_size, layer_weights.shape(m)[1])))
