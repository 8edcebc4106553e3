"""Decoding with a base LM and a Memory Decoder mixed in log space, each with its own KV cache.

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


def _pick(logp: torch.Tensor, temperature: float, top_p: float) -> int:
    """Greedy (``temperature`` 0) or nucleus sampling from ``logp`` ``(V,)``."""
    if temperature <= 0:
        return int(logp.argmax())
    probs = F.softmax(logp / temperature, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    outside = sorted_p.cumsum(-1) - sorted_p >= top_p                  # beyond the nucleus
    sorted_p = sorted_p.masked_fill(outside, 0.0)
    return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1)])


@torch.no_grad()
def generate_with_memory(base: nn.Module, memory: nn.Module, prompt_ids: list[int], max_new_tokens: int,
                         eos_id: int, lam: float, temperature: float = 0.0, top_p: float = 1.0,
                         device: str = "cpu", use_cache: bool = True,
                         on_token: Callable[[list[int]], None] | None = None) -> list[int]:
    """Continue ``prompt_ids`` from the mixture of ``base`` and ``memory`` (the interpolation [I]).

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
    models = (base, memory)
    was = [m.training for m in models]
    for m in models:
        m.eval()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)           # (1, T)
    caches: list = [None, None]
    import transformers
    cache_key = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"
    new: list[int] = []
    try:
        for _ in range(max_new_tokens):
            logps = []
            for n, m in enumerate(models):
                if use_cache:
                    feed = ids if caches[n] is None else ids[:, -1:]
                    out = m(input_ids=feed, use_cache=True, **{cache_key: caches[n]})
                    caches[n] = out.past_key_values  # the model's own cache, grown in place
                else:
                    out = m(input_ids=ids, use_cache=False)
                logps.append(F.log_softmax(out.logits[0, -1].float(), dim=-1))    # (V,)
            token = _pick(interpolate(logps[0], logps[1], lam), temperature, top_p)
            if token == eos_id:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
            if on_token is not None:
                on_token(new)
    finally:
        for m, w in zip(models, was):
            m.train(w)
    return new


__all__ = ["interpolate", "generate_with_memory"]
