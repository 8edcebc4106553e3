"""KV-cache quantization (needs transformers; import on use).

* :func:`make_cache` — a ``transformers`` ``Cache`` for ``fp``, ``nsnquant`` or ``kivi``
  (the hook ``rankwise generate --kv-cache nsnquant --kv-bits 2`` calls);
* :func:`cache_perplexity` — held-out perplexity with that cache, token by token;
* :class:`NSNQuant`, :class:`KIVI` — the chunk quantizers;
* :func:`bits_per_element` — stored bits per element with metadata, next to the nominal bits;
  :func:`kivi_for_budget` — KIVI's bits and chunk for a bits-per-element budget (equal bytes).

Example::

    from rankwise.compress.kv import make_cache
    cache = make_cache("nsnquant", bits=2)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
"""
from rankwise.compress.kv.cache import QuantizedKVCache, QuantizedKVLayer, find_rotary, make_cache
from rankwise.compress.kv.evaluate import cache_perplexity, fp16_bytes_per_token
from rankwise.compress.kv.quantizers import KIVI, NSNQuant, bits_per_element, kivi_for_budget

__all__ = ["make_cache", "cache_perplexity", "fp16_bytes_per_token", "find_rotary", "bits_per_element",
           "kivi_for_budget", "QuantizedKVCache", "QuantizedKVLayer", "NSNQuant", "KIVI"]
