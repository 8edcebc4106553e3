"""Settings of ``lowrank-hb`` and ``lowrank-adam``; the only defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rankwise.configs import bounded
from rankwise.optim.common import betas_problems


@dataclass
class LowRankHBConfig:
    """Heavy-ball momentum on the fixed-rank manifold for ``lowrank`` layers (Schotthoefer,
    Klein, Kusch; "A geometric framework for momentum-based optimizers for low-rank training",
    NeurIPS 2025, arXiv 2506.17475). Defaults are ours.

    Attributes:
        name: Registry name.
        lr: Step size on the factorized layers (an SGD step size; 3e-3 was the best of
            {1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3} in 60 steps of the lowrank-pretrain model).
        momentum: ``beta`` of the heavy-ball momentum.
        weight_decay: Decoupled decay of ``W = U S V^T`` (scales ``S``) and of the AdamW group.
        head_lr: Learning rate of the AdamW group that trains every other trainable parameter
            (embeddings, norms, a task head).
        betas: That AdamW group's betas.
        eps: That AdamW group's epsilon.
    """

    name: str = "lowrank-hb"
    lr: float = bounded(3e-3, gt=0, hint="such as 1e-3")
    momentum: float = bounded(0.9, ge=0, lt=1, hint="such as 0.9")
    weight_decay: float = bounded(0.0, ge=0)
    head_lr: float = bounded(1e-3, gt=0, hint="such as 1e-3")
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-8, ge=0)

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        return betas_problems(self.betas)


@dataclass
class LowRankAdamConfig:
    """Adam on the fixed-rank manifold for ``lowrank`` layers (same paper as
    :class:`LowRankHBConfig`). Defaults are ours.

    Attributes:
        name: Registry name.
        lr: Step size on the factorized layers (an Adam step size).
        betas: Adam's (beta1, beta2) on the tangent coordinates.
        eps: Adam's epsilon.
        weight_decay: Decoupled decay of ``W = U S V^T`` and of the AdamW group.
        head_lr: Learning rate of the AdamW group for every other trainable parameter;
            ``null`` uses ``lr``.
    """

    name: str = "lowrank-adam"
    lr: float = bounded(1e-3, gt=0, hint="such as 1e-3")
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-8, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    head_lr: Optional[float] = bounded(None, gt=0)

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        return betas_problems(self.betas)
