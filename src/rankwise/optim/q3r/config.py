"""Settings of ``q3r``; the only defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from rankwise.configs import bounded
from rankwise.optim.common import betas_problems


@dataclass
class Q3RConfig:
    """AdamW plus the Q3R rank regularizer (Ghosh, Nguyen, Kuemmerle; NeurIPS 2025).

    Defaults follow the authors' code where it has one: reweighting every 5 steps,
    ``lam = 0.1``, the monotone ``eps <- min(eps, sigma_{r+1})`` smoothing schedule.

    Attributes:
        name: Registry name.
        lr: Peak learning rate (all groups; also multiplies the regularizer step).
        weight_decay: Decoupled weight decay (all groups).
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon.
        rank: Target rank, read per ``m x n`` matrix as the authors' code does
            (:func:`rankwise.optim.q3r.target_rank`): an integer is multiplied by the aspect
            ratio ``max(m, n) / min(m, n)`` (unless ``scale_rank`` is false), a fraction in
            ``(0, 1)`` is ``fraction * max(m, n)``. A matrix whose rank comes out at
            ``min(m, n)`` or more is left to AdamW. The same rule gives the rank kept by
            :func:`rankwise.optim.q3r.truncate_to_factorized` after training.
        scale_rank: Multiply an integer ``rank`` by each matrix's aspect ratio (the authors'
            code); false uses it as is for every matrix.
        update_every: Reweighting period: the SVD of each regularized weight is refreshed every
            this many steps; in between only the quadratic is evaluated.
        lam: ``lambda``, the regularizer's weight.
        targets: ``"block-linear"`` (linear weights in the transformer blocks), ``"all-linear"``,
            a regex over module paths, or name suffixes (the adapters' target language).
        reweight: How reweightings after the first find the singular triplets: ``"subspace"``
            (warm-started subspace iteration from the previous ones, ``O(mnr)``; ours, for speed)
            or ``"eigh"`` (an exact float64 eigendecomposition every time, the authors' SVD).
        power_iters: Power iterations per ``"subspace"`` reweighting. One keeps the step time
            within 1.15x AdamW's on the lowrank-pretrain model; across reweightings the
            iterations accumulate (the basis is carried over), and on a slowly moving weight one
            iteration lands within ~10-15% of the subspace's drift between reweightings of the
            exact decomposition (two: ~2%; tests/optim/test_q3r.py).
    """

    name: str = "q3r"
    lr: float = bounded(1e-3, gt=0, hint="such as 1e-3")
    weight_decay: float = bounded(0.0, ge=0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-8, ge=0)
    rank: Union[int, float] = 32
    scale_rank: bool = True
    update_every: int = bounded(5, ge=1, hint="such as 200")
    lam: float = bounded(0.1, ge=0, hint="such as 0.1")
    targets: Union[list[str], str] = "block-linear"
    reweight: Literal["subspace", "eigh"] = "subspace"
    power_iters: int = bounded(1, ge=1, hint="such as 2")

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        out = betas_problems(self.betas)
        if not (self.rank >= 1 and float(self.rank).is_integer()) and not 0 < self.rank < 1:
            out.append(f"rank: got {self.rank}; expected a positive integer such as 32 or a "
                       "fraction of max(m, n) in (0, 1) such as 0.05")
        return out
