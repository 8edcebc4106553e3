"""What a compressor is: a layer-wise transform ``W -> compact tensors -> Ŵ``.

Registry kind ``"compressor"``: ``registry.register("compressor", name, Config, Class)``; the
builder is the :class:`Compressor` subclass itself, called with the validated config. The
model-level pipeline (:mod:`rankwise.compress.pipeline`) streams calibration activations block
by block, hands each target layer's weight and input Gram matrix to :meth:`Compressor.compress`,
and writes the decoded weight back; a compressor that refines a whole block after its layers
are compressed (3BASiL's transformer matching) overrides :meth:`Compressor.refine_block`.

The compact form is what a compressor *stores*: sparse values with a bit mask or N:M indices,
low-rank factors, bit-packed codes with their scales or lattice generators. ``Ŵ`` is always
``decode(tensors)``, so the dense model written for transformers and the compact file agree
exactly, and the bytes reported are the bytes of those tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn


@dataclass
class Compressed:
    """One compressed layer.

    Attributes:
        tensors: The compact form, ``{key: tensor}`` (what ``compression.safetensors`` holds).
        weight: ``decode(tensors)``, shape ``(out, in)``, float32.
        params: Parameters the compact form keeps (nonzeros + factor entries; for quantizers
            the number of weights, each at ``bits``).
        info: Method-specific numbers for the report (achieved sparsity, ADMM objective...).
    """

    tensors: dict[str, torch.Tensor]
    weight: torch.Tensor
    params: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the compact form."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


# refine_block(...)'s view of the calibration data: forward(i) runs the block (as it is now,
# with autograd on) on calibration batch i and returns its output hidden states.
BlockForward = Callable[[int], torch.Tensor]


class Compressor:
    """Base class of the registered compressors.

    Subclasses implement :meth:`compress` and :meth:`decode`; the class docstring names the
    paper and the algorithm it implements.

    Attributes:
        config: The validated config (its class is the registry entry's ``config_cls``).
        needs_hessian: The layer objective needs the input Gram matrix ``H = XᵀX / n``
            (magnitude pruning and round-to-nearest do not; they still get it for the report).
        refines_blocks: :meth:`refine_block` does something (the pipeline then keeps the dense
            block's outputs as targets).
    """

    needs_hessian: ClassVar[bool] = True
    refines_blocks: ClassVar[bool] = False

    def __init__(self, config: Any) -> None:
        self.config = config
        # Storage dtype of floating values (sparse values, factors): the model's weight dtype;
        # the pipeline sets it, so a float16 model is not charged float32 bytes.
        self.value_dtype = torch.float32

    def compress(self, weight: torch.Tensor, hessian: torch.Tensor) -> Compressed:
        """Compress one layer.

        Args:
            weight: ``(out, in)`` float32 weight (a copy; it may be modified).
            hessian: ``(in, in)`` float32 ``XᵀX / n`` of the layer's calibration inputs.

        Returns:
            The compact form and its decoded weight.
        """
        raise NotImplementedError

    def decode(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """Rebuild the ``(out, in)`` float32 weight from the compact form (no calibration data).

        Args:
            tensors: What :meth:`compress` stored.
            shape: ``(out, in)``.

        Returns:
            The decoded weight.
        """
        raise NotImplementedError

    def refine_block(self, block: nn.Module, layers: dict[str, Compressed], forward: BlockForward,
                     targets: list[torch.Tensor]) -> dict[str, Compressed]:
        """Refine a whole block after its layers were compressed (default: nothing).

        Args:
            block: The block, its target layers holding the decoded weights.
            layers: ``{path relative to the block: Compressed}``.
            forward: ``forward(i)``: the block's output on calibration batch ``i`` (with grad).
            targets: The dense block's outputs on the same inputs, one per batch.

        Returns:
            The (possibly new) compressed layers; the pipeline writes their weights back.
        """
        return layers


def relative_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """``‖WX − ŴX‖² / ‖WX‖²`` from the Gram matrix ``H = XᵀX / n`` (exact, no activations kept).

    Args:
        weight: ``(out, in)``.
        approx: ``(out, in)``.
        hessian: ``(in, in)``.

    Returns:
        The relative squared output error (0 when ``WX`` is zero and nothing changed).
    """
    w, d, h = weight.double(), (weight - approx).double(), hessian.double()
    num = float(((d @ h) * d).sum())
    den = float(((w @ h) * w).sum())
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def damped(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """``H + damp · mean(diag H) · I`` with dead inputs (zero diagonal) given a unit diagonal,
    the regularisation SparseGPT and GPTQ use before inverting ``H``."""
    h = hessian.double().clone()
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0
    mean = float(torch.diagonal(h).mean())
    h += damp * mean * torch.eye(h.shape[0], dtype=h.dtype)
    return h
