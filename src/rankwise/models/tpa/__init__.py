"""Tensor Product Attention and the T6 model family (Zhang et al., 2025), registered with
transformers' ``AutoConfig`` / ``AutoModelForCausalLM`` on import (model type ``rankwise-tpa``)."""
from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from rankwise.models.tpa.attention import TPAttention
from rankwise.models.tpa.cache import TPACache
from rankwise.models.tpa.config import TPAConfig
from rankwise.models.tpa.modeling import TPAForCausalLM, TPAModel

AutoConfig.register(TPAConfig.model_type, TPAConfig, exist_ok=True)
AutoModelForCausalLM.register(TPAConfig, TPAForCausalLM, exist_ok=True)

__all__ = ["TPACache", "TPAConfig", "TPAForCausalLM", "TPAModel", "TPAttention"]
