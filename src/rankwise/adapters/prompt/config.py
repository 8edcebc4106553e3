"""Prompt methods' configurations (docs/adapters-mixture-prompt.md): the one place their
defaults live.

All three put trainable vectors in front of the input sequence (virtual tokens) instead of
changing weights; only those vectors (and the task head, for classification) train.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from rankwise.configs import bounded


@dataclass
class PromptTuningConfig:
    """Prompt tuning (Lester et al. 2021): ``n`` trainable embeddings prepended to the input.

    Trainable parameters: ``num_virtual_tokens * hidden``. Prompt tuning needs large steps:
    a suitable AdamW learning rate is 1e-2 to 3e-1 (Lester et al. use 0.3 with Adafactor).

    Attributes:
        name: Registry name (``prompt-tuning``).
        num_virtual_tokens: Prompt length n (>= 1; n plus the longest sequence must fit the
            model's positions).
        init: ``vocab`` (embeddings of n tokens drawn uniformly from the vocabulary, PEFT's
            ``SAMPLE_VOCAB``) or ``random`` (N(0, std of the embedding matrix)).
        modules_to_save: Whole modules trained with the prompt (``None``: the task head).
    """

    name: str = "prompt-tuning"
    num_virtual_tokens: int = bounded(20, ge=1)
    init: Literal["vocab", "random"] = "vocab"
    modules_to_save: Union[list[str], None] = None


@dataclass
class PtMoeConfig:
    """PT-MoE (Li et al., NeurIPS 2025, arXiv 2505.09519): a router picks, per input, among
    ``num_experts`` prompts ``P_i = A_i B`` whose factor ``B`` is shared.

    Trainable parameters: ``num_experts * n * rank + rank * hidden + hidden * num_experts``.
    A suitable AdamW learning rate is prompt tuning's range, 1e-2 to 1e-1.

    Attributes:
        name: Registry name (``pt-moe``).
        num_virtual_tokens: Prompt length n (>= 1).
        num_experts: Prompts N (>= 1).
        rank: Inner size R of the decomposition (``R <= min(N n, hidden)``).
        top_k: Prompts mixed per input (the paper's routing reads as top-1).
        noise_std: sigma of the multiplicative router noise ``l (1 + eps)``, ``eps ~ N(0,
            sigma^2)``, in training. The paper's value was not in what we could read; 0.1 keeps
            ``1 + eps`` positive (``P(1 + eps < 0) = Phi(-1/sigma)``: 1e-23 at 0.1, 16% at the
            former default 1.0, where a sixth of the training forwards flipped the router's
            preference) while still perturbing the logits by about 10%.
        modules_to_save: Whole modules trained with the prompts (``None``: the task head).
    """

    name: str = "pt-moe"
    num_virtual_tokens: int = bounded(20, ge=1)
    num_experts: int = bounded(4, ge=1)
    rank: int = bounded(8, ge=1)
    top_k: int = bounded(1, ge=1)
    noise_std: float = bounded(0.1, ge=0)
    modules_to_save: Union[list[str], None] = None

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        out = []
        if 1 <= self.num_experts < self.top_k:
            out.append(f"top_k: got {self.top_k}, more than num_experts={self.num_experts}; "
                       f"choose top_k <= {self.num_experts}")
        return out


@dataclass
class CaptConfig:
    """CaPT, capsule prompt-tuning (arXiv 2510.16670): one instance-aware capsule per layer at
    position 0.

    Trainable parameters: ``layers * hidden`` (one task-aware vector per transformer block).
    A suitable AdamW learning rate is prompt tuning's range, 1e-2 to 1e-1.

    Attributes:
        name: Registry name (``capt``).
        blocks: Path of the ``ModuleList`` of transformer blocks, or ``auto`` (the longest
            ``ModuleList`` of identical blocks: ``bert.encoder.layer``, ``model.layers``...).
        modules_to_save: Whole modules trained with the capsules (``None``: the task head).
    """

    name: str = "capt"
    blocks: str = "auto"
    modules_to_save: Union[list[str], None] = None

    def problems(self) -> list[str]:
        """Return value errors (none: ``blocks`` is checked against the model when applied)."""
        return []
