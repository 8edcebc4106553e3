"""The ``none`` compressor: keeps every weight (the dense reference row, and the KV-cache-only
evaluation mode of ``rankwise compress``)."""
from __future__ import annotations

from dataclasses import dataclass

from rankwise.compress.base import Compressed, Compressor
from rankwise.compress.config import CompressConfig


@dataclass
class NoneConfig(CompressConfig):
    """No compression: only the shared ``compress:`` keys."""


class Identity(Compressor):
    """Stores the weight as it is: ``Ŵ = W``."""

    needs_hessian = False

    def compress(self, weight, hessian):
        """The weight itself, in the model's dtype."""
        w = weight.to(self.value_dtype).contiguous()
        return Compressed({"weight": w}, w.float(), w.numel())

    def decode(self, tensors, shape):
        """The stored weight."""
        return tensors["weight"].float()
