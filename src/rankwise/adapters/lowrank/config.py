"""Configuration of the ``lowrank`` method: the one place its defaults live."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rankwise.adapters.common.config import TargetedConfig
from rankwise.configs import bounded


@dataclass
class LowRankConfig(TargetedConfig):
    """Factorized low-rank layers ``U S V^T`` (Schotthoefer et al., NeurIPS 2025; trained by ``lowrank-hb`` /
    ``lowrank-adam``, or any optimizer on the factors).

    Attributes:
        name: Registry name (``lowrank``).
        rank: ``r`` of every factorization; at most ``min(in, out)`` of each layer.
        mode: ``adapter``: ``W = W0 + U S V^T`` with ``W0`` frozen, ``S = 0`` at the start
            (fine-tuning; the full adapter protocol holds). ``factorized``: ``W = U S V^T``
            replaces the dense weight, initialised from its truncated SVD (low-rank training
            from scratch, or compressing a trained layer); the dense weight is released.
        targets: ``"all-linear"``, ``"block-linear"``, a regex over module paths, or names.
        exclude: Name suffixes never adapted.
        modules_to_save: Whole modules trained and saved with the factors; ``None`` means the
            task head for classification models.
    """

    name: str = "lowrank"
    rank: int = bounded(8, ge=1)
    mode: Literal["adapter", "factorized"] = "adapter"
