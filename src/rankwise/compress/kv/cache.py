"""A transformers ``Cache`` that quantizes keys and values as they arrive."""
from __future__ import annotations

from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer

from rankwise.compress.kv.quantizers import KIVI, NSNQuant


def quantizers(kind: str, bits: int, seed: int = 0) -> tuple[Any, Any]:
    """``(key quantizer, value quantizer)`` of a cache kind (``nsnquant`` or ``kivi``)."""
    if kind == "nsnquant":
        q = NSNQuant(bits, seed)
        return q, q
    return KIVI(bits, per_channel=True), KIVI(bits, per_channel=False)


class QuantizedKVLayer(DynamicLayer):
    """One attention layer's cache: complete chunks of ``chunk`` tokens are quantized; the
    newest incomplete chunk stays in full precision (KIVI's residual), and attention reads the
    dequantized chunks followed by the full-precision tail.

    The dequantized chunks are kept (in the states' dtype) so each step only decodes the new
    chunk: this simulates the quantized cache's numerics; the bytes it would occupy are
    :meth:`quantized_bytes`.

    Args:
        key_quantizer: Encodes/decodes a ``(B, H, T, d)`` chunk of keys.
        value_quantizer: The same for values.
        chunk: Tokens per quantized chunk (1 quantizes every token on arrival).
    """

    is_croppable = False

    def __init__(self, key_quantizer: Any, value_quantizer: Any, chunk: int) -> None:
        super().__init__()
        self.kq, self.vq, self.chunk = key_quantizer, value_quantizer, chunk
        self.cumulative_length = 0
        self.quantized_tokens = 0
        self.stored_bytes = 0
        self._deq_k: torch.Tensor | None = None
        self._deq_v: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new states, quantize every complete chunk, return all keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._deq_k = key_states[..., :0, :]
            self._deq_v = value_states[..., :0, :]
        self.cumulative_length += key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        while self.keys.shape[-2] >= self.chunk:
            k, self.keys = self.keys[..., : self.chunk, :], self.keys[..., self.chunk:, :]
            v, self.values = self.values[..., : self.chunk, :], self.values[..., self.chunk:, :]
            qk, qv = self.kq.encode(k), self.vq.encode(v)
            self.stored_bytes += self.kq.nbytes(qk) + self.vq.nbytes(qv)
            self.quantized_tokens += self.chunk
            self._deq_k = torch.cat([self._deq_k, self.kq.decode(qk).to(k.dtype)], dim=-2)
            self._deq_v = torch.cat([self._deq_v, self.vq.decode(qv).to(v.dtype)], dim=-2)
        return torch.cat([self._deq_k, self.keys], dim=-2), torch.cat([self._deq_v, self.values], dim=-2)

    def get_seq_length(self) -> int:
        """Tokens cached (quantized and full-precision)."""
        return self.cumulative_length

    def reset(self) -> None:
        """Forget everything."""
        super().reset()
        self.quantized_tokens = self.stored_bytes = 0
        self._deq_k = self._deq_v = None


class QuantizedKVCache(Cache):
    """A ``Cache`` of :class:`QuantizedKVLayer`, one per attention layer (created lazily).

    Args:
        kind: ``nsnquant`` or ``kivi``.
        bits: Bits per element (NSNQuant 1 or 2; KIVI 1-8).
        chunk: Tokens quantized together.
        seed: Seed of NSNQuant's synthetic codebook.
    """

    def __init__(self, kind: str, bits: int, chunk: int = 16, seed: int = 0) -> None:
        kq, vq = quantizers(kind, bits, seed)
        super().__init__(layer_class_to_replicate=lambda: QuantizedKVLayer(kq, vq, chunk))
        self.kind, self.bits, self.chunk = kind, bits, chunk

    def bytes_per_token(self) -> float:
        """Stored bytes per quantized token, keys and values of every layer, per sequence."""
        per_layer = []
        for layer in self.layers:
            if layer.quantized_tokens:
                batch = layer._deq_k.shape[0]
                per_layer.append(layer.stored_bytes / (layer.quantized_tokens * batch))
        return float(sum(per_layer))


def make_cache(kind: str, bits: int = 2, chunk: int = 16, config: Any = None, seed: int = 0) -> Cache:
    """A KV cache for ``model(..., cache=...)`` / ``model.generate(..., past_key_values=...)``.

    This is the hook ``rankwise generate --kv-cache KIND --kv-bits BITS`` calls.

    Args:
        kind: ``fp`` (transformers' full-precision ``DynamicCache``), ``nsnquant`` (1-2 bits)
            or ``kivi`` (1-8 bits).
        bits: Bits per cached element (ignored by ``fp``).
        chunk: Tokens quantized together; the newest incomplete chunk stays full precision.
        config: The model's config (``fp`` uses it to lay out its layers).
        seed: Seed of NSNQuant's synthetic codebook.

    Returns:
        A fresh ``transformers.cache_utils.Cache``.

    Raises:
        RankwiseError: An unknown kind, or bits the kind does not support.
    """
    from rankwise.errors import RankwiseError
    kinds = ("fp", "nsnquant", "kivi")
    if kind not in kinds:
        raise RankwiseError(f"unknown KV cache {kind!r}; expected one of {list(kinds)}")
    if kind == "nsnquant" and bits not in (1, 2):
        raise RankwiseError(f"nsnquant KV cache: got {bits} bits; it supports 1 or 2")
    if kind == "kivi" and not 1 <= bits <= 8:
        raise RankwiseError(f"kivi KV cache: got {bits} bits; it supports 1 to 8")
    if chunk < 1:
        raise RankwiseError(f"KV cache chunk: got {chunk}; expected an integer >= 1")
    if kind == "fp":
        from transformers import DynamicCache
        return DynamicCache(config=config) if config is not None else DynamicCache()
    return QuantizedKVCache(kind, bits, chunk, seed)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of the model's cache argument (``cache`` in transformers 5, else
    ``past_key_values``)."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


CacheFactory = Callable[[], Cache]
