"""Held-out perplexity of a causal LM whose attention reads a (quantized) KV cache."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.compress.kv.cache import cache_kwarg, find_rotary
from rankwise.compress.kv.caches import build_cache, cache_config
from rankwise.compress.kv.config import KVCacheConfig


def fp16_bytes_per_token(config) -> int:
    """Bytes per token of a float16 KV cache: keys and values of every layer and KV head."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * 2 * config.num_hidden_layers * heads * head_dim


def cache_perplexity(model: nn.Module, windows: torch.Tensor, kind: str | KVCacheConfig, bits: int = 2,
                     chunk: int = 16, batch_size: int = 16, step: int = 1, seed: int = 0) -> dict:
    """Feed each window through ``model`` ``step`` tokens at a time with a fresh cache of
    ``kind``, so every prediction attends to the cached (quantized) keys and values of the
    tokens before it, and score the next-token predictions.

    With ``kind="fp"`` this equals the ordinary full-window perplexity (tested).

    Args:
        model: A causal LM (``AutoModelForCausalLM``).
        windows: ``(N, T)`` token ids.
        kind: ``fp``, ``nsnquant``, ``kivi`` (see :func:`~rankwise.compress.kv.make_cache`), or a
            cache config (``compress.kv_cache``; ``bits`` and ``chunk`` are then its own).
        bits: Bits per cached element (with a name).
        chunk: Tokens quantized together (with a name).
        batch_size: Windows per forward.
        step: Tokens per forward (1 = token-by-token decoding).
        seed: NSNQuant's codebook seed.

    Returns:
        ``{"eval_loss", "eval_perplexity", "bytes_per_token", "fp16_bytes_per_token",
        "bits_per_element"}``; the bytes count the quantized part (the full-precision tail is at
        most ``chunk − 1`` tokens); ``bits_per_element`` is ``16 · bytes_per_token /
        fp16_bytes_per_token``, metadata included (compare it with the nominal ``bits``).

    Raises:
        RankwiseError: See :func:`~rankwise.compress.kv.make_cache`.
    """
    cfg = cache_config(kind, bits=bits, chunk=chunk)  # a bad setting fails before any forward
    was_training = model.training
    model.eval()
    arg = cache_kwarg(model)
    rotary = find_rotary(model)
    total, count, per_token = 0.0, 0, []
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            ids = windows[start: start + batch_size]
            cache = build_cache(cfg, model.config, rotary, seed)
            for t in range(0, ids.shape[1] - 1, step):
                piece = ids[:, t: min(t + step, ids.shape[1] - 1)]
                logits = model(input_ids=piece, use_cache=True, **{arg: cache}).logits
                target = ids[:, t + 1: t + 1 + piece.shape[1]]
                total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                               target.reshape(-1), reduction="sum"))
                count += target.numel()
            if hasattr(cache, "bytes_per_token"):
                per_token.append(cache.bytes_per_token())
    model.train(was_training)
    loss = total / max(count, 1)
    fp16 = fp16_bytes_per_token(model.config)
    per = sum(per_token) / len(per_token) if per_token else float(fp16)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)),
            "bytes_per_token": per, "fp16_bytes_per_token": fp16, "bits_per_element": 16 * per / fp16}
