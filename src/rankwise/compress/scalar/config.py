"""Configs of the scalar quantizers: round-to-nearest and GPTQ."""
from __future__ import annotations

from dataclasses import dataclass

from rankwise.compress.config import CompressConfig, Quantization

BITS = (2, 3, 4, 8)


@dataclass
class RTNConfig(Quantization, CompressConfig):
    """Round-to-nearest: the ``compress:`` keys plus ``bits`` (2, 3, 4 or 8) and ``group_size``."""

    def problems(self) -> list[str]:
        """Return value errors."""
        return CompressConfig.problems(self) + self.quant_problems(BITS)


@dataclass
class GPTQConfig(RTNConfig):
    """GPTQ.

    Attributes:
        block_size: Columns whose updates are applied lazily together.
        damp: ``H += damp · mean(diag H) · I`` before inverting.
    """

    block_size: int = 128
    damp: float = 0.01

    def problems(self) -> list[str]:
        """Return value errors."""
        out = super().problems()
        if self.block_size < 1:
            out.append(f"block_size: got {self.block_size}; expected an integer >= 1")
        if self.damp <= 0:
            out.append(f"damp: got {self.damp}; expected a positive number such as 0.01")
        return out
