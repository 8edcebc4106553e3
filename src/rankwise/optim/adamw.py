"""``adamw``: torch's AdamW over the trainable parameters (the reference optimizer)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from rankwise import registry
from rankwise.optim.common import check_common, elementwise_state_floats, trainable_parameters


@dataclass
class AdamWConfig:
    """AdamW settings (Loshchilov & Hutter 2019).

    Attributes:
        name: Registry name.
        lr: Peak learning rate.
        weight_decay: Decoupled weight decay.
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon.
        per_layer: Step each parameter in the backward as soon as its gradient is complete and
            free the gradient (:mod:`rankwise.engine.per_layer`): a full fine-tuning step then
            never holds every gradient. Needs ``train.grad_accum: 1`` and no clipping
            (``train.grad_clip: auto`` turns clipping off).
    """

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    per_layer: bool = False

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        return check_common(self.lr, self.weight_decay, self.betas, self.eps)


def build_adamw(model: nn.Module, config: AdamWConfig) -> torch.optim.Optimizer:
    """Return ``torch.optim.AdamW`` over ``model``'s trainable parameters.

    Args:
        model: The model to train.
        config: The ``optim:`` section.

    Returns:
        The optimizer.
    """
    return torch.optim.AdamW(trainable_parameters(model), lr=config.lr, betas=tuple(config.betas),
                             eps=config.eps, weight_decay=config.weight_decay)


registry.register("optimizer", "adamw", AdamWConfig, build_adamw, summary="torch.optim.AdamW",
                  state_floats=elementwise_state_floats(2), lr_grid=(1e-3, 3e-3, 1e-2))
