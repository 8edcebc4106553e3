"""Configs of the pruning baselines: magnitude, Wanda, SparseGPT."""
from __future__ import annotations

from dataclasses import dataclass

from rankwise.compress.config import CompressConfig, Sparsity
from rankwise.configs import bounded


@dataclass
class MagnitudeConfig(Sparsity, CompressConfig):
    """Magnitude pruning: the ``compress:`` keys plus ``sparsity`` / ``pattern``."""

    def problems(self) -> list[str]:
        """Return value errors."""
        return CompressConfig.problems(self) + self.sparsity_problems()

    def layer_problems(self, path: str, shape: tuple[int, int]) -> list[str]:
        """An N:M pattern must tile the layer's inputs."""
        return self.pattern_layer_problems(path, shape)


@dataclass
class WandaConfig(MagnitudeConfig):
    """Wanda: the same keys as magnitude pruning."""


@dataclass
class SparseGPTConfig(MagnitudeConfig):
    """SparseGPT.

    Attributes:
        block_size: Columns processed together (the lazy batch of updates; the adaptive
            unstructured mask is chosen per block).
        damp: ``H += damp · mean(diag H) · I`` before inverting.
    """

    block_size: int = bounded(128, ge=1)
    damp: float = bounded(0.01, gt=0, hint="such as 0.01")

    def problems(self) -> list[str]:
        """Return value errors."""
        out = super().problems()
        nm = self.nm if not any(p.startswith("pattern") for p in out) else None
        if nm and self.block_size % nm[1]:
            out.append(f"block_size: got {self.block_size}; with pattern {self.pattern} it must be "
                       f"a multiple of M={nm[1]}")
        return out
