"""``adamw``: torch's AdamW over the trainable parameters (the reference optimizer)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from rankwise import registry


@dataclass
class AdamWConfig:
    """AdamW settings (Loshchilov & Hutter 2019).

    Attributes:
        name: Registry name.
        lr: Peak learning rate.
        weight_decay: Decoupled weight decay.
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon.
    """

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        out = []
        if self.lr <= 0:
            out.append(f"lr: got {self.lr}; expected a positive number")
        if len(self.betas) != 2:
            out.append(f"betas: got {self.betas}; expected two numbers")
        return out


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Return the parameters that require grad (deduplicated, in model order)."""
    seen, out = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def build_adamw(model: nn.Module, config: AdamWConfig) -> torch.optim.Optimizer:
    """Return ``torch.optim.AdamW`` over ``model``'s trainable parameters."""
    return torch.optim.AdamW(trainable_parameters(model), lr=config.lr, betas=tuple(config.betas),
                             eps=config.eps, weight_decay=config.weight_decay)


registry.register("optimizer", "adamw", AdamWConfig, build_adamw, summary="torch.optim.AdamW")
