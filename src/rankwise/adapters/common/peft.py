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


def token_rows(model: nn.Module, adapter_name: str, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """PEFT's ``trainable_token_indices`` and tensors for the trainable-token layers of adapter
    ``adapter_name`` (:mod:`rankwise.core.tokens`), or ``(None, {})`` when it has none.

    PEFT's TrainableTokens stores each trained row's *value*, not a delta: the tensor
    ``<prefix><path>.token_adapter.trainable_tokens_delta`` holds ``W[ids] + Δ`` and replaces
    those rows of the base table when loaded. A tied head is PEFT's list form (PEFT ties the
    head to the embedding itself); an untied head is the dict form ``{embedding: ids, head:
    ids}``, one tensor each. Because the rows are replaced, PEFT reproduces the trained model
    on a base resized with any init of the new rows, as long as every new token is trained.

    Args:
        model: The adapted model.
        adapter_name: The adapter.
        prefix: PEFT's key prefix (``base_model.model.``).

    Returns:
        ``(trainable_token_indices, tensors)``.
    """
    from rankwise.core.protocol import adapter_modules
    from rankwise.core.tokens import TokenHeadRows, TokenRows
    indices: dict[str, list[int]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for path, mod in adapter_modules(model):
        if not isinstance(mod, (TokenRows, TokenHeadRows)) or adapter_name not in mod.token_ids:
            continue
        if isinstance(mod, TokenHeadRows) and mod.tied is not None:
            continue  # PEFT ties the head to the embedding's rows itself
        ids = mod.token_ids[adapter_name]
        w = mod.weight
        rows = w[torch.tensor(ids, device=w.device)].float() + mod.deltas[adapter_name].detach().float()
        tensors[f"{prefix}{path}.token_adapter.trainable_tokens_delta"] = rows.to(w.dtype).cpu().contiguous()
        indices[path] = ids
    if not indices:
        return None, {}
    if len(indices) == 1:  # the embedding alone, or with a tied head
        return next(iter(indices.values())), tensors
    return indices, tensors
