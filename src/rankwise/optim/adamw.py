"""``adamw``: torch's AdamW over the trainable parameters (the reference optimizer)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from rankwise import registry
from rankwise.configs import KEY_HINTS, bounded
from rankwise.optim import loraplus
from rankwise.optim.common import MatrixAdamW, betas_problems, trainable_parameters
from rankwise.optim.lowbit import bits_problems, moment_floats


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
        state_bits: ``8``: both moments stored as blockwise 8-bit codes plus one float32 maximum
            per 256 elements (Dettmers et al. 2022; :mod:`rankwise.optim.lowbit`); ``null``:
            float32 (``torch.optim.AdamW`` itself).
        loraplus_lr_ratio: LoRA+ (Hayou et al. 2024): the B factor of every low-rank pair (and
            every trainable 1-D tensor, as PEFT's ``create_loraplus_optimizer``) steps at
            ``lr * loraplus_lr_ratio``, A and the rest at ``lr`` (:mod:`rankwise.optim.loraplus`;
            the paper suggests 16); ``null``: one rate for all.
        loraplus_lr_embedding: With LoRA+, the rate of pairs on embedding layers (PEFT's
            ``loraplus_lr_embedding``).
    """

    name: str = "adamw"
    lr: float = bounded(1e-3, gt=0, hint="such as 1e-3")
    weight_decay: float = bounded(0.0, ge=0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-8, ge=0)
    per_layer: bool = False
    state_bits: Optional[int] = None
    loraplus_lr_ratio: Optional[float] = bounded(None, gt=0, what="eta_B / eta_A",
                                                 hint="(the paper uses 16; null: plain AdamW)")
    loraplus_lr_embedding: float = bounded(1e-6, ge=0, what="a learning rate")

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        return betas_problems(self.betas) + bits_problems(self.state_bits)


def build_adamw(model: nn.Module, config: AdamWConfig) -> torch.optim.Optimizer:
    """Return ``torch.optim.AdamW`` over ``model``'s trainable parameters.

    Args:
        model: The model to train.
        config: The ``optim:`` section.

    Returns:
        The optimizer: with ``state_bits``, :class:`rankwise.optim.common.MatrixAdamW` with no
        projected group (AdamW's arithmetic, moments quantised), else ``torch.optim.AdamW``;
        with ``loraplus_lr_ratio``, over LoRA+'s param groups.

    Raises:
        RankwiseError: ``loraplus_lr_ratio`` on a model without trainable low-rank pairs.
    """
    params = (trainable_parameters(model) if config.loraplus_lr_ratio is None else
              loraplus.loraplus_param_groups(model, config.lr, config.loraplus_lr_ratio,
                                             config.loraplus_lr_embedding))
    if config.state_bits:
        return MatrixAdamW(params, lr=config.lr, betas=tuple(config.betas),
                           eps=config.eps, weight_decay=config.weight_decay, state_bits=config.state_bits)
    return torch.optim.AdamW(params, lr=config.lr, betas=tuple(config.betas),
                             eps=config.eps, weight_decay=config.weight_decay)


def adamw_state_floats(model: nn.Module, config: AdamWConfig) -> float:
    """Two moments per trainable element; with ``state_bits: 8`` each moment of ``k`` elements
    costs ``k / 4 + ceil(k / 256)`` floats (1-byte codes + a float32 maximum per block)."""
    bits = getattr(config, "state_bits", None)
    return sum(2 * moment_floats(p.numel(), bits) for p in trainable_parameters(model))


for _key in ("loraplus_lr_ratio", "loraplus_lr_embedding"):  # on any other optimizer: one line
    KEY_HINTS[f"optim.{_key}"] = loraplus.HINT

registry.register("optimizer", "adamw", AdamWConfig, build_adamw, summary="torch.optim.AdamW",
                  state_floats=adamw_state_floats, lr_grid=(1e-3, 3e-3, 1e-2))
