"""AltLoRA and AltLoRA+ (ROADMAP A3): optimizers for LoRA pairs; one registration each."""
from __future__ import annotations

import torch
from torch import nn

from rankwise import registry
from rankwise.optim.altlora.config import AltLoraConfig, AltLoraPlusConfig
from rankwise.optim.altlora.optimizer import AltLoRA, altlora_param_groups

__all__ = ["AltLoRA", "AltLoraConfig", "AltLoraPlusConfig", "altlora_param_groups", "build_altlora"]


def build_altlora(model: nn.Module, config: AltLoraConfig) -> torch.optim.Optimizer:
    """Return :class:`AltLoRA` over ``model``'s LoRA pairs, plus AdamW for other trainables.

    Args:
        model: A model with trainable LoRA adapters (method ``lora`` or ``gora``).
        config: :class:`AltLoraConfig` (AltLoRA+ when it is an :class:`AltLoraPlusConfig`).

    Returns:
        The optimizer.

    Raises:
        RankwiseError: If the model has no trainable LoRA pair.
    """
    groups = altlora_param_groups(model, head_lr=config.head_lr, head_eps=config.head_eps)
    return AltLoRA(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                   weight_decay=config.weight_decay, reg=config.reg,
                   plus=isinstance(config, AltLoraPlusConfig), mode=config.mode,
                   alternate_every=config.alternate_every)


registry.register("optimizer", "altlora", AltLoraConfig, build_altlora,
                  summary="AltLoRA: alternating least-squares LoRA steps, low-rank momentum (NeurIPS 2025)")
registry.register("optimizer", "altlora-plus", AltLoraPlusConfig, build_altlora,
                  summary="AltLoRA+: AltLoRA with a second moment (NeurIPS 2025, Algorithm 2)")
