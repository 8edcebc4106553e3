"""NEFTune: uniform noise on the input embeddings of the forwards that train.

Jain et al. 2024, "NEFTune: Noisy Embeddings Improve Instruction Finetuning", Algorithm 1: the
embeddings ``X_emb (B, L, d)`` of a training batch become ``X_emb + (alpha / sqrt(L d)) eps``
with ``eps ~ Uniform(-1, 1)`` elementwise (``train.neftune_noise_alpha``; the paper tries 5, 10
and 15).

Which ``L``: each example's own length, its non-padded tokens (the ``attention_mask`` row sum),
and no noise on padding - the paper's released code. transformers' ``neftune_post_forward_hook``
(what ``Trainer`` / TRL's ``neftune_noise_alpha`` attach) uses the padded width ``T`` of the batch
for every row and noises the padding too; the two are the same on a batch without padding (a
packed block, equal lengths: tested to float rounding with the same seed). A forward without an
attention mask (packing) counts the whole row, as there.

When: the embedding module in training mode *and* gradients enabled, i.e. exactly the forwards
whose loss is backpropagated. Evaluation (eval mode), generation, and the no-gradient forwards
of DPO's reference and GRPO's rollouts see the clean embeddings. (The HF hook checks the
training mode only, so a reference forward under ``torch.no_grad`` in training mode is noised
there.)
"""
from __future__ import annotations

import math

import torch
from torch import nn

from rankwise.core.token_mask import valid_tokens
from rankwise.errors import RankwiseError


class NEFTune:
    """The noise, as three hooks: the model's forward pre-hook records the attention mask, the
    input embedding's forward hook adds the noise, the model's forward hook forgets the mask
    (so an embedding called outside a model forward, as prompt tuning does, counts whole rows).

    Args:
        alpha: ``alpha`` (> 0).
    """

    def __init__(self, alpha: float) -> None:
        self.alpha = float(alpha)
        self.mask: torch.Tensor | None = None

    def record(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the model: keep this forward's 2-D ``attention_mask``."""
        mask = kwargs.get("attention_mask")
        self.mask = mask if torch.is_tensor(mask) and mask.dim() == 2 else None

    def forget(self, model: nn.Module, args: tuple, kwargs: dict, output) -> None:
        """Forward hook of the model: the mask never outlives its forward."""
        self.mask = None

    def noise(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        """Forward hook of the input embeddings: ``output + alpha / sqrt(L_i d) eps`` on the real
        tokens of each row ``i`` in a training forward; ``None`` (unchanged) otherwise."""
        if not (module.training and torch.is_grad_enabled()) or output.dim() != 3:
            return None
        rows, width, dim = output.shape                              # (B, T, d)
        valid = valid_tokens(self.mask, (rows, width))               # (B, T) bool, or None
        if valid is None:
            valid = torch.ones(rows, width, dtype=torch.bool, device=output.device)
        lengths = valid.sum(-1).clamp(min=1).to(torch.float32)       # (B,) L_i
        scale = self.alpha / torch.sqrt(lengths * dim)               # (B,)
        eps = torch.zeros_like(output).uniform_(-1.0, 1.0)           # (B, T, d)
        return output + eps * (scale[:, None, None] * valid[..., None]).to(output.dtype)


def add_neftune(model: nn.Module, alpha: float) -> NEFTune:
    """Attach NEFTune to ``model`` (a transformers model: ``get_input_embeddings``).

    Args:
        model: The (adapted) model; its forward receives ``attention_mask`` as a keyword.
        alpha: ``train.neftune_noise_alpha``.

    Returns:
        The hooks' owner (``.alpha``).

    Raises:
        RankwiseError: If the model has no input embeddings to perturb.
    """
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(emb, nn.Module):
        raise RankwiseError("train.neftune_noise_alpha perturbs the input embeddings, and this model "
                         "has none (get_input_embeddings); remove it")
    hooks = NEFTune(alpha)
    model.register_forward_pre_hook(hooks.record, with_kwargs=True)
    model.register_forward_hook(hooks.forget, with_kwargs=True)
    emb.register_forward_hook(hooks.noise)
    return hooks


__all__ = ["NEFTune", "add_neftune"]
