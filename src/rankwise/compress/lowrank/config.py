"""Config of the truncated-SVD baseline."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from rankwise.compress.config import CompressConfig
from rankwise.configs import bounded


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

    rank: Union[int, None] = bounded(None, ge=1, hint="(null: use energy)")
    energy: float = bounded(0.9, gt=0.0, le=1.0, what="a fraction")
    whiten: bool = False
    damp: float = 0.01

    def layer_problems(self, path: str, shape: tuple[int, int]) -> list[str]:
        """The rank must fit the layer."""
        if self.rank is not None and self.rank > min(shape):
            return [f"rank: {self.rank} is larger than layer {path} {tuple(shape)} allows "
                    f"({min(shape)}); lower compress.rank"]
        return []
