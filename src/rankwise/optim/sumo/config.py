"""Settings of ``sumo``; the only defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from rankwise.configs import bounded
from rankwise.optim.common import betas_problems
from rankwise.optim.lowbit import bits_problems
from rankwise.optim.oja import projector_problems


@dataclass
class SumoConfig:
    """SUMO: subspace-aware moment orthogonalization by exact SVD (Refael et al. 2025).

    Attributes:
        name: Registry name.
        lr: Peak learning rate (all groups).
        weight_decay: Decoupled weight decay (all groups).
        momentum: ``mu``, decay of the single (first) moment of projected matrices.
        rank: Subspace dimension ``r`` (``>= min(m, n)``: no projection, i.e. exact-SVD Muon).
        update_every: ``K``: the subspace is recomputed from the gradient every ``K`` steps and
            the moment is transported into it.
        scale: ``alpha``, the paper's scale of the update ``lr * alpha * Q_t O_t``, the same
            for every matrix (``scale_rule: uniform``). The paper's value is not known to us;
            5.0 gives the 128-wide lowrank-pretrain model's block matrices (rank 32) an update
            RMS of 0.16-0.22, near AdamW's, so one ``lr`` serves the AdamW groups too (for
            another model, ``0.2 sqrt(m n / r)`` of its typical block matrix does the same).
            With ``scale_rule: rms``, the target RMS of each matrix's update instead (0.2).
        scale_rule: ``"uniform"`` (the paper: ``alpha`` for every matrix) or ``"rms"`` (ours
            before issue 27: ``alpha * sqrt(m n / r)``, which makes every matrix's update RMS
            ``alpha`` whatever its shape; Moonlight's RMS matching).
        residual: Block 4 of the official README, the "original space update": also step along
            the gradient outside the subspace, ``phi (G - Q Q^T G)`` with
            ``phi = ||O||_F / ||Q^T G||_F`` (our reading, after Fira; the exact scaling is not
            published in any text we could read, hence off by default).
        norm_growth: ``gamma`` of the norm-growth limiter on that residual term (Fira's 1.01):
            its norm may grow by at most this factor per step; ``null``: no limiter. Needs
            ``residual``.
        betas: Adam's betas for the matrices that are not projected (embeddings, norms, heads).
        eps: Adam's epsilon for those matrices.
        targets: ``"block-linear"`` (linear weights in the transformer blocks), ``"all-linear"``,
            a regex over module paths, or name suffixes (the adapters' target language).
        svd: How the subspace is found: ``"eigh"`` (eigenvectors of the small Gram matrix
            ``G G^T``: the same top-r span as an SVD, about 4x cheaper on CPU; the paper uses a
            randomized SVD here for the same reason) or ``"svd"`` (a thin SVD).
        projector: ``"svd"`` (a new subspace every ``update_every`` steps) or ``"oja"`` (one
            streaming block-Oja step every step, the moment transported each time; see
            :mod:`rankwise.optim.oja`).
        oja_lr: ``eta``, the dimensionless Oja step (``projector: oja``).
        oja_bits: Store the Oja tracker as int8 codes of this many bits (2..8); ``null``: float.
        state_bits: ``8``: the momentum and the AdamW moments stored as blockwise 8-bit codes
            (:mod:`rankwise.optim.lowbit`); ``null``: float32.
        seed: Seed of the tracker's stochastic rounding.
        per_layer: Step each parameter in the backward as soon as its gradient is complete and
            free the gradient (:mod:`rankwise.engine.per_layer`): a full fine-tuning step then
            never holds every gradient. Needs ``train.grad_accum: 1`` and no clipping
            (``train.grad_clip: auto`` turns clipping off).
    """

    name: str = "sumo"
    lr: float = bounded(1e-3, gt=0, hint="such as 1e-3")
    weight_decay: float = bounded(0.0, ge=0)
    momentum: float = bounded(0.9, ge=0, lt=1, hint="such as 0.9")
    rank: int = bounded(128, ge=1, hint="such as 64")
    update_every: int = bounded(200, ge=1, hint="such as 200")
    scale: float = bounded(5.0, gt=0, hint="such as 5.0")
    scale_rule: Literal["uniform", "rms"] = "uniform"
    residual: bool = False
    norm_growth: Optional[float] = bounded(None, ge=1, what="a factor", hint="such as 1.01")
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-8, ge=0)
    targets: Union[list[str], str] = "block-linear"
    svd: Literal["svd", "eigh"] = "eigh"
    projector: Literal["svd", "oja"] = "svd"
    oja_lr: float = bounded(1.0, gt=0, hint="such as 1.0")
    oja_bits: Optional[int] = bounded(None, ge=2, le=8, hint="(int8 codes)")
    seed: int = 0
    per_layer: bool = False
    state_bits: Optional[int] = None

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        out = betas_problems(self.betas)
        if self.norm_growth is not None and not self.residual:
            out.append("norm_growth: limits the residual term; set residual: true or norm_growth: null")
        return out + projector_problems(self.projector, self.oja_bits) + bits_problems(self.state_bits)
