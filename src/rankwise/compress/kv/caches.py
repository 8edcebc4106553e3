"""The registered KV caches (kind ``kv-cache``): their builders, and a cache from a name or a
config. Importing this module needs only torch; the builders import transformers.

A ``kv-cache`` entry's builder is ``builder(config, model_config=None, rotary=None, seed=0)
-> transformers Cache``: ``config`` its checked config (:mod:`rankwise.compress.kv.config`),
``model_config`` the model's config (``fp`` lays out its layers with it), ``rotary`` the model's
rotary embedding (pre-RoPE key quantization), ``seed`` NSNQuant's codebook seed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rankwise import registry
from rankwise.compress.kv.config import KVCacheConfig
from rankwise.configs import from_dict, problems_of
from rankwise.errors import RankwiseError


def fp_cache(config: KVCacheConfig, model_config: Any = None, rotary: torch.nn.Module | None = None,
             seed: int = 0) -> Any:
    """transformers' full-precision ``DynamicCache`` (``fp``'s builder)."""
    from transformers import DynamicCache
    return DynamicCache(config=model_config) if model_config is not None else DynamicCache()


def quantized_cache(config: KVCacheConfig, model_config: Any = None,
                    rotary: torch.nn.Module | None = None, seed: int = 0) -> Any:
    """A :class:`~rankwise.compress.kv.cache.QuantizedKVCache` of the config's quantizers
    (``nsnquant``'s and ``kivi``'s builder)."""
    from rankwise.compress.kv.cache import QuantizedKVCache
    key_q, value_q = config.quantizers(seed)
    return QuantizedKVCache(key_q, value_q, config.chunk, rotary)


def cache_config(cache: str | KVCacheConfig, **settings: Any) -> KVCacheConfig:
    """The checked config of a KV cache.

    Args:
        cache: A registered name (``fp``, ``nsnquant``, ``kivi``) or a config.
        **settings: With a name: its keys (``bits``, ``chunk``); those the cache does not have
            are left out (``fp`` has no ``bits``).

    Returns:
        The entry's config.

    Raises:
        RankwiseError: An unknown name (with "did you mean"), or values out of the cache's ranges.
    """
    if isinstance(cache, KVCacheConfig):
        bad = problems_of(cache)
        if bad:
            raise RankwiseError("; ".join(f"kv_cache.{p}" for p in bad))
        return cache
    cls = registry.get("kv-cache", str(cache)).config_cls
    keys = {f.name for f in dataclasses.fields(cls)}
    return from_dict(cls, {k: v for k, v in settings.items() if k in keys}, "kv_cache")


def build_cache(config: KVCacheConfig, model_config: Any = None,
                rotary: torch.nn.Module | None = None, seed: int = 0) -> Any:
    """A fresh cache of ``config``, made by its registered builder (see the module docstring)."""
    config = cache_config(config)
    return registry.get("kv-cache", config.name).builder(config, model_config=model_config,
                                                         rotary=rotary, seed=seed)


def make_cache(kind: str | KVCacheConfig, bits: int = 2, chunk: int = 16, config: Any = None,
               seed: int = 0, rotary: torch.nn.Module | None = None) -> Any:
    """A KV cache for ``model(..., cache=...)`` / ``model.generate(..., past_key_values=...)``.

    Args:
        kind: ``fp`` (transformers' full-precision ``DynamicCache``), ``nsnquant`` (1-2 bits),
            ``kivi`` (1-8 bits), another registered ``kv-cache``, or a cache config.
        bits: Bits per cached element (with a name; ``fp`` has none).
        chunk: Tokens quantized together; the newest incomplete chunk stays full precision.
        config: The model's config (``fp`` uses it to lay out its layers).
        seed: Seed of NSNQuant's synthetic codebook.
        rotary: The model's rotary embedding (:func:`~rankwise.compress.kv.cache.find_rotary`);
            NSNQuant then quantizes keys before RoPE, as its paper does (without it: after
            RoPE, as received).

    Returns:
        A fresh ``transformers.cache_utils.Cache``.

    Raises:
        RankwiseError: An unknown cache, or settings outside its ranges.
    """
    return build_cache(cache_config(kind, bits=bits, chunk=chunk), config, rotary, seed)


def quantizers(kind: str | KVCacheConfig, bits: int = 2, seed: int = 0) -> tuple[Any, Any] | None:
    """``(key quantizer, value quantizer)`` of a cache (``None`` for ``fp``)."""
    return cache_config(kind, bits=bits).quantizers(seed)


def bits_per_element(kind: str | KVCacheConfig, bits: int, head_dim: int, chunk: int) -> float:
    """Bits per cached element of a ``kind`` cache, keys and values averaged, metadata
    included (the nominal ``bits`` is what the label says; this is what is stored).

    Args:
        kind: ``fp`` (float16: 16), ``nsnquant``, ``kivi`` (or a cache config).
        bits: Nominal bits per element.
        head_dim: The attention head dimension.
        chunk: Tokens quantized together.

    Returns:
        ``(bits per key element + bits per value element) / 2``.
    """
    pair = cache_config(kind, bits=bits, chunk=chunk).quantizers()
    if pair is None:
        return 16.0
    return (pair[0].bits_per_element(head_dim, chunk) + pair[1].bits_per_element(head_dim, chunk)) / 2


def kivi_for_budget(budget: float, head_dim: int,
                    chunks: tuple[int, ...] = (16, 32, 64, 128, 256)) -> tuple[int, int]:
    """KIVI's ``(bits, chunk)`` for a budget of stored bits per element, so that KIVI can be
    compared with another cache at equal *total* bytes: the most bits that fit, at the
    smallest chunk (finest groups) that keeps :func:`bits_per_element` within the budget.

    Args:
        budget: Bits per element the KIVI cache may store (e.g. NSNQuant's
            :func:`bits_per_element`).
        head_dim: The attention head dimension.
        chunks: Chunk sizes (tokens per key group) to choose from.

    Returns:
        ``(bits, chunk)``.

    Raises:
        ValueError: If not even 1-bit KIVI at the largest chunk fits.
    """
    for b in range(8, 0, -1):
        for c in sorted(chunks):
            if bits_per_element("kivi", b, head_dim, c) <= budget + 1e-9:
                return b, c
    raise ValueError(f"KIVI budget: got {budget} bits per element; 1-bit KIVI needs at least "
                     f"{bits_per_element('kivi', 1, head_dim, max(chunks)):.3f} at head_dim={head_dim}; "
                     "raise the budget or allow larger chunks")


__all__ = ["bits_per_element", "build_cache", "cache_config", "fp_cache", "kivi_for_budget",
           "make_cache", "quantized_cache", "quantizers"]
