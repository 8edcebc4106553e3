"""What rankwise's writers of HF PEFT folders share (LoRA's ``LORA`` and prompt tuning's
``PROMPT_TUNING`` formats): the file names, PEFT's task type of a model, and the atomic write of
the adapter tensors with the trained heads (``modules_to_save``). safetensors is imported when a
folder is written.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise.core import atomic

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_TASKS = (("ForSequenceClassification", "SEQ_CLS"), ("ForCausalLM", "CAUSAL_LM"),
          ("LMHeadModel", "CAUSAL_LM"), ("ForTokenClassification", "TOKEN_CLS"),
          ("ForQuestionAnswering", "QUESTION_ANS"), ("ForConditionalGeneration", "SEQ_2_SEQ_LM"))


def peft_task_type(model: nn.Module) -> str | None:
    """PEFT's ``task_type`` for a transformers model, from its class name (``None`` if unknown)."""
    name = type(model).__name__
    return next((task for suffix, task in _TASKS if name.endswith(suffix)), None)


def write_peft_folder(out_dir: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                      model: nn.Module, saved: list[str], prefix: str) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` atomically.

    Args:
        out_dir: Target folder (replaced only when writing succeeded).
        config: The PEFT config.
        tensors: The adapter tensors by PEFT key.
        model: The model whose whole modules ``saved`` are written beside them.
        saved: Paths of the modules to save (the trained heads).
        prefix: PEFT's key prefix of those modules (``base_model.model.`` for LoRA).

    Returns:
        The folder written.
    """
    from safetensors.torch import save_file
    tensors = dict(tensors)
    for path in saved:
        for key, p in model.get_submodule(path).named_parameters():
            tensors[f"{prefix}{path}.{key}"] = p.detach().cpu().contiguous()
    out_dir = Path(out_dir)
    with atomic.folder(out_dir) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        atomic.write_json(tmp / CONFIG, config)
    return out_dir
