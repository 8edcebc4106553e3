"""Settings of ``nanoadam``; the only defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rankwise.optim.common import check_common


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
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    density: float = 0.1
    final_density: Optional[float] = None
    mask_interval: int = 100
    density_interval: int = 100
    total_steps: int = 1000

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        out = check_common(self.lr, self.weight_decay, self.betas, self.eps)
        for key in ("density", "final_density"):
            value = getattr(self, key)
            if value is not None and not 0 < value <= 1:
                out.append(f"{key}: got {value}; expected a fraction in (0, 1] such as 0.1")
        for key in ("mask_interval", "density_interval", "total_steps"):
            if getattr(self, key) < 1:
                out.append(f"{key}: got {getattr(self, key)}; expected a positive integer such as 100")
        return out
