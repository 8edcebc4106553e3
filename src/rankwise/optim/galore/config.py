"""Settings of the GaLore-style optimizers (``galore``, ``galore-is``); the only defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from rankwise.configs import bounded
from rankwise.optim.common import betas_problems
from rankwise.optim.lowbit import bits_problems
from rankwise.optim.oja import projector_problems


@dataclass
class GaLoreConfig:
    """GaLore: Adam moments kept in a rank-``r`` subspace of each gradient (Zhao et al. 2024).

    Defaults follow the GaLore paper's pre-training scripts (rank 128, subspace refresh every
    200 steps, scale 0.25) except ``lr`` (1e-3, the rankwise default for every optimizer).

    Attributes:
        name: Registry name.
        lr: Peak learning rate (all groups).
        weight_decay: Decoupled weight decay (all groups).
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon (added after the square root, as ``torch.optim.AdamW``).
        rank: Subspace dimension ``r`` of each projected matrix; ranks at or above
            ``min(m, n)`` mean no projection (plain AdamW for that matrix).
        update_every: ``T``: the subspace is recomputed from the gradient every ``T`` steps.
        scale: ``alpha``: multiplies the back-projected update of projected matrices.
        targets: Which linear layers' weights are projected, in the adapters' target language:
            ``"block-linear"`` (the linear layers inside the transformer blocks), ``"all-linear"``,
            a regex over module paths, or name suffixes (see :func:`rankwise.optim.common.split_params`).
        svd: ``"svd"`` (exact thin SVD, GaLore's choice) or ``"eigh"`` (eigenvectors of the
            small Gram matrix; same subspace, cheaper on CPU).
        stagger: Spread the refreshes of different matrices over the ``T`` steps instead of
            doing all of them on the same step (same amortised cost, flatter step times).
        select: ``"top"`` (the leading singular directions) or ``"sampled"``
            (importance sampling; the ``galore-is`` entry sets it).
        seed: Seed of the subspace sampling (``"sampled"``) and of the tracker's stochastic
            rounding (``oja_bits``).
        projector: How the subspace is kept current: ``"svd"`` (recomputed from the gradient
            every ``update_every`` steps, GaLore's rule) or ``"oja"`` (a streaming block-Oja step
            every step, QR re-orthonormalised; no SVD after the first step; see
            :mod:`rankwise.optim.oja`). ``update_every`` and ``stagger`` do not apply to ``oja``.
        oja_lr: ``eta``, the dimensionless Oja step (``projector: oja``).
        oja_bits: Store the Oja tracker as int8 codes of this many bits (2..8) with unbiased
            stochastic rounding of the tracker and of its update; ``null``: float.
        per_layer: Step each parameter in the backward as soon as its gradient is complete and
            free the gradient (:mod:`rankwise.engine.per_layer`): a full fine-tuning step then
            never holds every gradient. Needs ``train.grad_accum: 1`` and no clipping
            (``train.grad_clip: auto`` turns clipping off).
        state_bits: ``8``: Adam's moments (projected and plain) stored as blockwise 8-bit codes
            (:mod:`rankwise.optim.lowbit`, bitsandbytes' quantiser); ``null``: float32.
    """

    name: str = "galore"
    lr: float = bounded(1e-3, gt=0, hint="such as 1e-3")
    weight_decay: float = bounded(0.0, ge=0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-8, ge=0)
    rank: int = bounded(128, ge=1, hint="such as 64")
    update_every: int = bounded(200, ge=1, hint="such as 200")
    scale: float = bounded(0.25, gt=0, hint="such as 0.25")
    targets: Union[list[str], str] = "block-linear"
    svd: Literal["svd", "eigh"] = "svd"
    stagger: bool = False
    select: Literal["top", "sampled"] = "top"
    seed: int = 0
    projector: Literal["svd", "oja"] = "svd"
    oja_lr: float = bounded(1.0, gt=0, hint="such as 1.0")
    oja_bits: Optional[int] = bounded(None, ge=2, le=8, hint="(int8 codes)")
    per_layer: bool = False
    state_bits: Optional[int] = None

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        out = betas_problems(self.betas)
        out += projector_problems(self.projector, self.oja_bits)
        out += bits_problems(self.state_bits)
        if self.projector == "oja" and self.select == "sampled":
            out.append("projector: oja tracks the top-r subspace, but select: sampled draws "
                       "directions from an SVD; use projector: svd with sampled selection")
        return out


@dataclass
class GaLoreISConfig(GaLoreConfig):
    """GaLore with importance-sampled subspaces (Zhang et al. 2025, "Breaking the Frozen
    Subspace"). Same fields as :class:`GaLoreConfig`; only ``name`` and ``select`` differ."""

    name: str = "galore-is"
    select: Literal["top", "sampled"] = "sampled"
