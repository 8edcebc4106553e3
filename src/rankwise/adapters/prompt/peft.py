"""HF PEFT's prompt-tuning file format (``PROMPT_TUNING``), written without importing ``peft``.

What PEFT expects on disk (checked against peft 0.21 by saving real ``PeftModel`` objects):

* ``adapter_model.safetensors`` with ``prompt_embeddings`` ``(num_virtual_tokens, token_dim)``
  and, for a trained head (``modules_to_save``), ``base_model.<module path>.<param>``;
* ``adapter_config.json`` with ``peft_type: PROMPT_TUNING``, ``task_type``,
  ``num_virtual_tokens``, ``token_dim``, ``num_transformer_submodules: 1``, the model's
  ``num_attention_heads`` / ``num_layers`` and ``modules_to_save``.

PEFT then prepends the same vectors to ``inputs_embeds`` and extends the attention mask, so its
logits equal rankwise's (tested to 1e-5).
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from rankwise.adapters.common.peft import peft_task_type, write_peft_folder
from rankwise.adapters.prompt.generators import SoftPrompt
from rankwise.adapters.prompt.layer import PromptLayer
from rankwise.core.ops import modules_to_save
from rankwise.core.protocol import adapter_modules
from rankwise.errors import RankwiseError



def _soft_prompt(model: nn.Module, adapter_name: str) -> SoftPrompt:
    for _, mod in adapter_modules(model):
        if isinstance(mod, PromptLayer) and adapter_name in mod.adapter_names():
            gen = mod.prompts[adapter_name]
            if isinstance(gen, SoftPrompt):
                return gen
            raise RankwiseError(f"PEFT has no {type(gen).__name__} prompts (only PROMPT_TUNING); "
                                "export with --format rankwise")
    raise RankwiseError(f"no prompt-tuning adapter named {adapter_name!r} in the model; "
                        "export with --format rankwise")


def _config_value(model: nn.Module, *keys: str) -> int | None:
    cfg = getattr(model, "config", None)
    return next((getattr(cfg, k) for k in keys if isinstance(getattr(cfg, k, None), int)), None)


def export_prompt_peft(model: nn.Module, out_dir: str | Path, adapter_name: str = "default",
                       task_type: str | None = None, base_model_name_or_path: str | None = None) -> Path:
    """Write prompt-tuning adapter ``adapter_name`` in HF PEFT's format (atomically).

    Args:
        model: A transformers model with a rankwise ``prompt-tuning`` adapter.
        out_dir: Target folder (replaced only when writing succeeded).
        adapter_name: The adapter to export.
        task_type: PEFT task type; inferred from the model class when None.
        base_model_name_or_path: Recorded in the config (default: the model's ``_name_or_path``).

    Returns:
        The folder written.

    Raises:
        RankwiseError: If the model has no prompt-tuning adapter of that name (PT-MoE and CaPT
            have no PEFT format).
    """
    gen = _soft_prompt(model, adapter_name)
    saved = modules_to_save(model)
    config = {
        "peft_type": "PROMPT_TUNING",
        "task_type": task_type or peft_task_type(model),
        "base_model_name_or_path": base_model_name_or_path
        or getattr(getattr(model, "config", None), "_name_or_path", None) or None,
        "num_virtual_tokens": gen.num_tokens, "token_dim": int(gen.prompt_embeddings.shape[1]),
        "num_transformer_submodules": 1,
        "num_attention_heads": _config_value(model, "num_attention_heads", "n_head"),
        "num_layers": _config_value(model, "num_hidden_layers", "n_layer"),
        "prompt_tuning_init": "RANDOM", "prompt_tuning_init_text": None,
        "tokenizer_name_or_path": None, "inference_mode": True,
    }
    if saved:  # peft 0.13 has no such key for prompt tuning: written only when a head trains
        config["modules_to_save"] = saved
    tensors = {"prompt_embeddings": gen.prompt_embeddings.detach().cpu().contiguous()}
    return write_peft_folder(out_dir, config, tensors, model, saved, "base_model.")
