"""Prompt methods (Lester et al. 2021; PT-MoE, arXiv 2505.09519; CaPT, arXiv 2510.16670): prompt
tuning, PT-MoE and CaPT, registered here.

All three wrap the model's input embeddings in a :class:`PromptLayer` (the ``InputAdapter``
seam: the engine and evaluation see the prefix through
:func:`rankwise.core.protocol.transform_inputs`; the model's own forward and ``generate``, as HF
``Trainer`` and users' loops call them, through the input hook
:func:`rankwise.core.protocol.attach_input_hook` puts on the model) holding one prefix generator.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import train_only
from rankwise.adapters.prompt.config import CaptConfig, PromptTuningConfig, PtMoeConfig
from rankwise.adapters.prompt.generators import CapsulePrompt, PromptMixture, SoftPrompt
from rankwise.adapters.prompt.layer import PromptLayer, input_embeddings, max_positions
from rankwise.core.inject import replace_module
from rankwise.core.protocol import attach_input_hook
from rankwise.core.quant import keep_training_layout
from rankwise.errors import RankwiseError

__all__ = ["PromptTuningConfig", "PtMoeConfig", "CaptConfig", "PromptLayer", "SoftPrompt",
           "PromptMixture", "CapsulePrompt", "apply_prompt", "export_prompt_peft"]


def apply_prompt(model: nn.Module, config, adapter_name: str,
                 make: Callable[[nn.Embedding], nn.Module]) -> PromptLayer:
    """Wrap the input embeddings in a :class:`PromptLayer` holding ``make(table)``; only the
    generator (and the task head) trains.

    Args:
        model: A transformers model with input embeddings.
        config: The method config (``name``, ``modules_to_save``).
        adapter_name: Name of the adapter.
        make: Builds the generator from the embedding table.

    Returns:
        The wrapper.

    Raises:
        RankwiseError: If the model has no input embeddings, or the prompt does not leave room
            for a single token within the model's positions.
    """
    path, table = input_embeddings(model, config.name)
    keep_training_layout(model)  # 4-bit bases: no CPU inference repacking while adapted
    generator = make(table)
    limit = max_positions(model)
    if limit is not None and generator.num_tokens >= limit:
        raise RankwiseError(f"method.num_virtual_tokens: {generator.num_tokens} virtual tokens leave no "
                            f"room in the model's {limit} positions; choose fewer than {limit}")
    layer = model.get_submodule(path)
    if not isinstance(layer, PromptLayer):
        layer = PromptLayer(table)
        replace_module(model, path, layer)
    layer.add(adapter_name, generator)
    attach_input_hook(model)  # a plain model(...) / generate carries the virtual tokens too
    train_only(model, config, adapter_name)
    return layer


def apply_prompt_tuning(model: nn.Module, config: PromptTuningConfig, adapter_name: str = "default") -> PromptLayer:
    """Prompt tuning: ``num_virtual_tokens`` trainable vectors in front of the input."""
    return apply_prompt(model, config, adapter_name,
                        lambda t: SoftPrompt(t, config.num_virtual_tokens, config.init))


def apply_pt_moe(model: nn.Module, config: PtMoeConfig, adapter_name: str = "default") -> PromptLayer:
    """PT-MoE: routed prompts ``A_i B`` with a shared ``B``."""
    return apply_prompt(model, config, adapter_name, lambda t: PromptMixture(
        t, config.num_virtual_tokens, config.num_experts, config.rank, config.top_k, config.noise_std))


def apply_capt(model: nn.Module, config: CaptConfig, adapter_name: str = "default") -> PromptLayer:
    """CaPT: one instance-aware capsule per layer at position 0."""
    return apply_prompt(model, config, adapter_name,
                        lambda t: CapsulePrompt(model, config.blocks, t.embedding_dim))


def export_prompt_peft(*args, **kwargs):
    """See :func:`rankwise.adapters.prompt.peft.export_prompt_peft` (imports safetensors when called)."""
    from rankwise.adapters.prompt.peft import export_prompt_peft as _export
    return _export(*args, **kwargs)


registry.register("method", "prompt-tuning", PromptTuningConfig, apply_prompt_tuning,
                  exporters={"peft": export_prompt_peft},
                  summary="prompt tuning: trainable virtual tokens in front of the input (A8)")
registry.register("method", "pt-moe", PtMoeConfig, apply_pt_moe,
                  summary="PT-MoE: prompts A_i B with shared B, routed per input (A8)")
registry.register("method", "capt", CaptConfig, apply_capt,
                  summary="CaPT: one instance-aware capsule prompt per layer at position 0 (A8)")
