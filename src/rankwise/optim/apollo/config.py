"""Settings of APOLLO and APOLLO-Mini (``apollo``, ``apollo-mini``); the only defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from rankwise.configs import bounded
from rankwise.optim.common import betas_problems
from rankwise.optim.lowbit import bits_problems


@dataclass
class ApolloConfig:
    """APOLLO: AdamW's moments of a random projection set a channel-wise scale of the raw gradient
    (Zhu et al., MLSys 2025).

    Defaults follow the authors' package and scripts (``apollo-torch``: rank 256, projection
    redrawn every 200 steps, ``scale`` 1, channel-wise, norm-growth limit 1.01) except ``lr``
    (1e-3, the rankwise default for every optimizer).

    Attributes:
        name: Registry name.
        lr: Peak learning rate (all groups).
        weight_decay: Decoupled weight decay (all groups).
        betas: Adam's (beta1, beta2) of the projected moments.
        eps: Adam's epsilon (after bias correction, as ``torch.optim.AdamW``).
        rank: ``r``, rows of the random projection; ranks at or above ``min(m, n)`` mean no
            projection (plain AdamW for that matrix).
        update_every: ``T``: the random projection is redrawn every ``T`` steps.
        scale: The authors' ``scale``: the update is multiplied by ``alpha = sqrt(scale)``
            (the paper's grids are ``alpha`` in ``{sqrt 1, sqrt 2, sqrt 3}`` for APOLLO and
            ``{sqrt 128, ...}`` for APOLLO-Mini), compensating the rank-``r`` estimate's bias.
        scale_type: ``"channel"`` (one factor per column of the larger side: APOLLO) or
            ``"tensor"`` (one factor per matrix: APOLLO-Mini).
        norm_growth: ``gamma`` of the norm-growth limiter (Fira): the scaled gradient's norm may
            grow by at most this factor per step; ``null`` turns it off.
        targets: Which linear layers' weights are projected (see :class:`rankwise.optim.galore.GaLoreConfig`).
        seed: Seed of the random projections (each matrix and period has its own draw).
        state_bits: ``8``: Adam's moments stored as blockwise 8-bit codes
            (:mod:`rankwise.optim.lowbit`); ``null``: float32.
    """

    name: str = "apollo"
    lr: float = bounded(1e-3, gt=0, hint="such as 1e-3")
    weight_decay: float = bounded(0.0, ge=0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-8, ge=0)
    rank: int = bounded(256, ge=1, hint="such as 64")
    update_every: int = bounded(200, ge=1, hint="such as 200")
    scale: float = bounded(1.0, gt=0, hint="such as 1 (apollo) or 128 (apollo-mini)")
    scale_type: Literal["channel", "tensor"] = "channel"
    norm_growth: Optional[float] = bounded(1.01, ge=1, what="a factor", hint="such as 1.01")
    targets: Union[list[str], str] = "block-linear"
    seed: int = 0
    state_bits: Optional[int] = None

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        out = betas_problems(self.betas)
        if self.name == "apollo-mini" and (self.rank != 1 or self.scale_type != "tensor"):
            out.append(f"apollo-mini is rank 1 with tensor-wise scaling: got rank {self.rank}, scale_type "
                       f"{self.scale_type!r}; remove them or use optim.name: apollo")
        return out + bits_problems(self.state_bits)


@dataclass
class ApolloMiniConfig(ApolloConfig):
    """APOLLO-Mini: a rank-1 projection and one tensor-wise scale per matrix (Zhu et al. 2025,
    Sec. 4.2), ``scale`` 128 as the authors' scripts. Same fields as :class:`ApolloConfig`."""

    name: str = "apollo-mini"
    rank: int = bounded(1, ge=1, hint="such as 64")
    scale: float = bounded(128.0, gt=0, hint="such as 1 (apollo) or 128 (apollo-mini)")
    scale_type: Literal["channel", "tensor"] = "tensor"
