"""KV-cache quantization (needs transformers; import on use).

* :func:`make_cache` — a ``transformers`` ``Cache`` for ``fp``, ``nsnquant`` or ``kivi``
  (the hook ``rankwise generate --kv-cache nsnquant --kv-bits 2`` calls);
* :func:`cache_perplexity` — held-out perplexity with that cache, token by token;
* :class:`NSNQuant`, :class:`KIVI` — the chunk quantizers.

Example::

    from rankwise.compress.kv import make_cache
    cache = make_cache("nsnquant", bits=2)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
"""
from rankwise.compress.kv.cache import QuantizedKVCache, QuantizedKVLayer, make_cache
from rankwise.compress.kv.evaluate import cache_perplexity, fp16_bytes_per_token
from rankwise.compress.kv.quantizers import KIVI, NSNQuant

__all__ = ["make_cache", "cache_perplexity", "fp16_bytes_per_token", "QuantizedKVCache",
           "QuantizedKVLayer", "NSNQuant", "KIVI"]
