"""KV-cache quantization; each cache is an entry of registry kind ``kv-cache`` (``fp``,
``nsnquant``, ``kivi``) with its own config (:mod:`rankwise.compress.kv.config`), chosen as
``{name: nsnquant, bits: 2}`` in ``compress.kv_cache`` and ``decode.kv_cache``.

* :func:`make_cache` — a ``transformers`` ``Cache`` of a cache name or config (the hook
  ``rankwise generate --kv-cache nsnquant --kv-bits 2`` calls, through :func:`build_cache`);
* :func:`cache_perplexity` — held-out perplexity with that cache, token by token;
* :class:`NSNQuant`, :class:`KIVI` — the chunk quantizers;
* :func:`bits_per_element` — stored bits per element with metadata, next to the nominal bits;
  :func:`kivi_for_budget` — KIVI's bits and chunk for a bits-per-element budget (equal bytes).

Importing this package needs only torch (it registers the caches); the cache classes and
:func:`cache_perplexity` load transformers when first used.

Example::

    from rankwise.compress.kv import make_cache
    cache = make_cache("nsnquant", bits=2)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
"""
from __future__ import annotations

import importlib
from typing import Any

from rankwise import registry
from rankwise.compress.kv.caches import (bits_per_element, build_cache, cache_config, fp_cache,
                                         kivi_for_budget, make_cache, quantized_cache, quantizers)
from rankwise.compress.kv.config import FPCacheConfig, KIVICacheConfig, KVCacheConfig, NSNQuantCacheConfig
from rankwise.compress.kv.quantizers import KIVI, NSNQuant

registry.register("kv-cache", "fp", FPCacheConfig, fp_cache,
                  summary="full-precision cache (transformers' DynamicCache), the reference")
registry.register("kv-cache", "nsnquant", NSNQuantCacheConfig, quantized_cache,
                  summary="NSNQuant vector quantization, 1-2 bits, keys before RoPE")
registry.register("kv-cache", "kivi", KIVICacheConfig, quantized_cache,
                  summary="KIVI uniform quantization, 1-8 bits, keys per channel")

# names that need transformers, loaded on first use: name -> module
_LAZY = {"QuantizedKVCache": "cache", "QuantizedKVLayer": "cache", "find_rotary": "cache",
         "cache_perplexity": "evaluate", "fp16_bytes_per_token": "evaluate"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"rankwise.compress.kv.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["make_cache", "build_cache", "cache_config", "cache_perplexity", "fp16_bytes_per_token",
           "find_rotary", "bits_per_element", "kivi_for_budget", "quantizers", "QuantizedKVCache",
           "QuantizedKVLayer", "NSNQuant", "KIVI", "FPCacheConfig", "KIVICacheConfig",
           "KVCacheConfig", "NSNQuantCacheConfig"]
