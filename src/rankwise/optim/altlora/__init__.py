"""AltLoRA and AltLoRA+ (arXiv 2505.12455; docs/adaptive-rank.md): optimizers for low-rank
adapter pairs; one registration
each."""
from __future__ import annotations

from rankwise import registry
from rankwise.optim.altlora.config import AltLoraConfig, AltLoraPlusConfig
from rankwise.optim.altlora.optimizer import (AltLoRA, altlora_param_groups, altlora_state_floats,
                                              build_altlora)

__all__ = ["AltLoRA", "AltLoraConfig", "AltLoraPlusConfig", "altlora_param_groups",
           "altlora_state_floats", "build_altlora"]

# lr_grid: AltLoRA trains adapters, never from scratch, so its grids come from fine-tuning the
# demo task (see the configs' ``lr``): AltLoRA's lr is an SGD-like step (0.5 and 2 reached
# 74 / 77 %, 5 collapsed to 32 %); AltLoRA+'s is Adam-like (1e-4 / 5e-4 / 2e-3: 32 / 75 / 32 %).
registry.register("optimizer", "altlora", AltLoraConfig, build_altlora,
                  summary="AltLoRA: alternating least-squares LoRA steps, low-rank momentum (NeurIPS 2025)",
                  state_floats=altlora_state_floats, lr_grid=(0.5, 1.0, 2.0))
registry.register("optimizer", "altlora-plus", AltLoraPlusConfig, build_altlora,
                  summary="AltLoRA+: AltLoRA with a second moment (NeurIPS 2025, Algorithm 2)",
                  state_floats=altlora_state_floats, lr_grid=(1e-4, 5e-4, 2e-3))
