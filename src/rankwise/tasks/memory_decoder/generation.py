"""Decoding with a base LM and a Memory Decoder mixed in log space, each with its own KV cache:
a logits hook (:class:`MemoryMixture`) of the one decode loop.

Cao et al. 2025, "Memory Decoder" (arXiv 2508.09874), the inference interpolation [I] (the
authors' ``demo/memDec.py``): at every step

    p(y | x) = (1 - lambda) p_base(y | x) + lambda p_mem(y | x),

computed as ``logaddexp(log p_base + log(1 - lambda), log p_mem + log lambda)`` so no
probability underflows. The two models share the tokenizer but nothing else, so each keeps its
own transformers cache and is fed only the newest token after the prompt; no retrieval happens
at decode time.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.engine.generation import ModelStream, Step, generate


def interpolate(logp_base: torch.Tensor, logp_mem: torch.Tensor, lam: float) -> torch.Tensor:
    """``log((1 - lam) p_base + lam p_mem)`` from log-probabilities (the interpolation [I]).

    Args:
        logp_base: ``(..., V)`` log-probabilities of the base.
        logp_mem: ``(..., V)`` log-probabilities of the memory decoder.
        lam: The memory decoder's share in [0, 1].

    Returns:
        ``(..., V)`` mixed log-probabilities (``lam`` 0 or 1 gives one side exactly).
    """
    if lam <= 0.0:
        return logp_base
    if lam >= 1.0:
        return logp_mem
    return torch.logaddexp(logp_base + math.log1p(-lam), logp_mem + math.log(lam))


class MemoryMixture:
    """The interpolation [I] as a logits hook of the one decode loop
    (:func:`rankwise.engine.generation.decode`): the loop's logits are the base's; the Memory
    Decoder runs beside it as a :class:`~rankwise.engine.generation.ModelStream` (its own KV
    cache, fed only the newest token after the prompt), and the hook returns the mixture's
    log-probabilities ``log((1 − λ) p_base + λ p_mem)`` (the sampler's softmax of them is the
    mixture itself).

    Args:
        memory: The Memory Decoder (same tokenizer as the base).
        lam: Its share λ in [0, 1].
    """

    def __init__(self, memory: nn.Module, lam: float) -> None:
        self.stream, self.lam = ModelStream(memory), lam

    def __call__(self, step: Step, logits: torch.Tensor) -> torch.Tensor:
        """``(B, V)`` mixed log-probabilities of this step from the base's ``logits``."""
        logp_mem = F.log_softmax(self.stream.logits(step), dim=-1)
        return interpolate(F.log_softmax(logits, dim=-1), logp_mem, self.lam)


def generate_with_memory(base: nn.Module, memory: nn.Module, prompt_ids: list[int], max_new_tokens: int,
                         eos_id: int, lam: float, temperature: float = 0.0, top_p: float = 1.0,
                         device: str = "cpu", use_cache: bool = True,
                         on_token: Callable[[list[int]], None] | None = None) -> list[int]:
    """Continue ``prompt_ids`` from the mixture of ``base`` and ``memory`` (the interpolation [I]):
    the one decode loop over ``base`` with a :class:`MemoryMixture` hook.

    Args:
        base: The base causal LM.
        memory: The Memory Decoder (same tokenizer).
        prompt_ids: The prompt.
        max_new_tokens: Upper bound on new tokens.
        eos_id: Generation stops after this token (it is not returned).
        lam: The memory decoder's share.
        temperature: 0 = greedy; otherwise sampling at this temperature.
        top_p: Nucleus mass when sampling.
        device: Where the ids go.
        use_cache: Two KV caches (one per model; only the new token is fed); ``False``
            recomputes the whole sequence each step (the reference the cached path must equal).
        on_token: Called with the tokens generated so far after each step (streaming).

    Returns:
        The generated token ids.
    """
    was = memory.training
    try:
        return generate(base, prompt_ids, max_new_tokens, eos_id, eos_id, temperature, top_p, device,
                        hooks=[MemoryMixture(memory, lam)], use_cache=use_cache, on_tokens=on_token)
    finally:
        memory.train(was)


__all__ = ["MemoryMixture", "interpolate", "generate_with_memory"]
