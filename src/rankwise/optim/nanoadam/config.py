"""Settings of ``nanoadam``; the only defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rankwise.configs import bounded
from rankwise.optim.common import betas_problems


@dataclass
class NanoAdamConfig:
    """NanoAdam: Adam on the smallest-magnitude weights only (Zhou, Jacobs, Gadhikar, Burkholz;
    "Pay Attention to Small Weights", NeurIPS 2025, arXiv 2506.21374, Algorithm 1).

    Defaults are ours (the paper's values were not available to us): 10% of each matrix, the
    mask recomputed every 100 steps, a constant density.

    Attributes:
        name: Registry name.
        lr: Peak learning rate (all groups).
        weight_decay: Decoupled weight decay, applied to the selected entries only (the rest of
            a masked matrix must not move).
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon.
        density: ``k0 / N``: the fraction of each masked tensor that is updated, in (0, 1].
        final_density: Density at ``total_steps`` (cosine schedule from ``density``); ``null``
            keeps ``density`` throughout.
        mask_interval: ``m``: the mask ``Bottom_k(|theta|)`` is recomputed every ``m`` steps.
        density_interval: ``d``: the density schedule is evaluated every ``d`` steps (a new
            density also recomputes the mask).
        total_steps: ``T``, the length of the density schedule (only with ``final_density``).
    """

    name: str = "nanoadam"
    lr: float = bounded(1e-3, gt=0, hint="such as 1e-3")
    weight_decay: float = bounded(0.0, ge=0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-8, ge=0)
    density: float = bounded(0.1, gt=0, le=1, what="a fraction", hint="such as 0.1")
    final_density: Optional[float] = bounded(None, gt=0, le=1, what="a fraction", hint="such as 0.1")
    mask_interval: int = bounded(100, ge=1, hint="such as 100")
    density_interval: int = bounded(100, ge=1, hint="such as 100")
    total_steps: int = bounded(1000, ge=1, hint="such as 100")

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        return betas_problems(self.betas)
