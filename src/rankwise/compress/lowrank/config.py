"""Config of the truncated-SVD baseline."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from rankwise.compress.config import CompressConfig


@dataclass
class SVDConfig(CompressConfig):
    """Truncated SVD.

    Attributes:
        rank: Rank kept in every layer; ``None`` uses ``energy``.
        energy: With ``rank`` unset: the smallest rank whose singular values hold this fraction
            of the (whitened, with ``whiten``) squared Frobenius norm, per layer.
        whiten: Activation-aware: truncate ``W·H^{1/2}`` instead of ``W`` so the kept
            directions minimise the output error ``‖(W − Ŵ)X‖`` on calibration inputs.
        damp: ``H += damp · mean(diag H) · I`` before whitening.
    """

    rank: Union[int, None] = None
    energy: float = 0.9
    whiten: bool = False
    damp: float = 0.01

    def problems(self) -> list[str]:
        """Return value errors."""
        out = super().problems()
        if self.rank is not None and self.rank < 1:
            out.append(f"rank: got {self.rank}; expected an integer >= 1 (or null to use energy)")
        if not 0.0 < self.energy <= 1.0:
            out.append(f"energy: got {self.energy}; expected a fraction in (0, 1]")
        return out

    def layer_problems(self, path: str, shape: tuple[int, int]) -> list[str]:
        """The rank must fit the layer."""
        if self.rank is not None and self.rank > min(shape):
            return [f"rank: {self.rank} is larger than layer {path} {tuple(shape)} allows "
                    f"({min(shape)}); lower compress.rank"]
        return []
