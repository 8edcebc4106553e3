"""Configs of the scalar quantizers: round-to-nearest and GPTQ."""
from __future__ import annotations

from dataclasses import dataclass

from rankwise.compress.config import CompressConfig, Quantization
from rankwise.configs import bounded

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

    block_size: int = bounded(128, ge=1)
    damp: float = bounded(0.01, gt=0, hint="such as 0.01")
