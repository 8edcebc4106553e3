"""A transformers ``Cache`` that quantizes keys and values as they arrive."""
from __future__ import annotations

from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``J x`` with ``J`` the RoPE pairing of channel ``i`` with ``i + d/2`` (Llama's
    convention): ``[x₁, x₂] → [−x₂, x₁]``."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE ``x·cos + J(x)·sin`` on ``(B, H, T, d)`` with ``cos, sin`` ``(B, T, d)``."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`apply_rope`: ``(cos − sin·J) x / (cos² + sin²)`` (``J`` commutes
    with ``cos`` and ``sin``, whose channels ``i`` and ``i + d/2`` are equal; the division
    covers rotary embeddings that scale ``cos, sin`` by an attention factor)."""
    c, s = cos[:, None], sin[:, None]
    return (x * c - rotate_half(x) * s) / (c * c + s * s)


def find_rotary(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's rotary embedding module (``rotary_emb``: ``(x, position_ids) → (cos, sin)``),
    or ``None`` if it has none."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "rotary_emb":
            return module
    return None


def _position_ids(kwargs: dict) -> torch.Tensor | None:
    """``position_ids`` the attention layer forwarded to ``Cache.update`` (transformers 5
    passes the attention's keyword arguments as ``kwargs=...``)."""
    for d in (kwargs, kwargs.get("kwargs") or {}, kwargs.get("cache_kwargs") or {}):
        if isinstance(d, dict) and d.get("position_ids") is not None:
            return d["position_ids"]
    return None


class QuantizedKVLayer(DynamicLayer):
    """One attention layer's cache: complete chunks of ``chunk`` tokens are quantized; the
    newest incomplete chunk stays in full precision (KIVI's residual), and attention reads the
    dequantized chunks followed by the full-precision tail.

    The dequantized chunks are kept (in the states' dtype) so each step only decodes the new
    chunk: this simulates the quantized cache's numerics; the bytes it would occupy are
    ``stored_bytes``.

    Pre-RoPE keys: a key quantizer with ``pre_rope = True`` (NSNQuant) gets the keys before
    RoPE. The cache receives rotated keys, so it recomputes their ``cos, sin`` with the model's
    ``rotary`` module at their positions (``position_ids`` when the model passes them, else
    the running token index), undoes the rotation, quantizes, and rotates the dequantized keys
    back: cached key = ``RoPE_pos(decode(encode(k_pre)))``, which is what a kernel applying
    RoPE after dequantization computes.

    Args:
        key_quantizer: Encodes/decodes a ``(B, H, T, d)`` chunk of keys.
        value_quantizer: The same for values.
        chunk: Tokens per quantized chunk (1 quantizes every token on arrival).
        rotary: The model's rotary embedding (:func:`find_rotary`); without it keys are
            quantized as received (after RoPE).
    """

    is_croppable = False

    def __init__(self, key_quantizer: Any, value_quantizer: Any, chunk: int,
                 rotary: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.kq, self.vq, self.chunk = key_quantizer, value_quantizer, chunk
        self.rotary = rotary if getattr(key_quantizer, "pre_rope", False) else None
        self._cos: torch.Tensor | None = None           # (B, pending tokens, d), beside self.keys
        self._sin: torch.Tensor | None = None
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
        if self.rotary is not None:
            cos, sin = self._rope(key_states, kwargs)
            self._cos = cos if self._cos is None else torch.cat([self._cos, cos], dim=-2)
            self._sin = sin if self._sin is None else torch.cat([self._sin, sin], dim=-2)
        self.cumulative_length += key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        while self.keys.shape[-2] >= self.chunk:
            k, self.keys = self.keys[..., : self.chunk, :], self.keys[..., self.chunk:, :]
            v, self.values = self.values[..., : self.chunk, :], self.values[..., self.chunk:, :]
            if self.rotary is not None:                   # quantize k before RoPE, rotate after
                cos, self._cos = self._cos[:, : self.chunk], self._cos[:, self.chunk:]
                sin, self._sin = self._sin[:, : self.chunk], self._sin[:, self.chunk:]
                qk = self.kq.encode(undo_rope(k.float(), cos.float(), sin.float()))
                deq_k = apply_rope(self.kq.decode(qk), cos.float(), sin.float())
            else:
                qk = self.kq.encode(k)
                deq_k = self.kq.decode(qk)
            qv = self.vq.encode(v)
            self.stored_bytes += self.kq.nbytes(qk) + self.vq.nbytes(qv)
            self.quantized_tokens += self.chunk
            self._deq_k = torch.cat([self._deq_k, deq_k.to(k.dtype)], dim=-2)
            self._deq_v = torch.cat([self._deq_v, self.vq.decode(qv).to(v.dtype)], dim=-2)
        return torch.cat([self._deq_k, self.keys], dim=-2), torch.cat([self._deq_v, self.values], dim=-2)

    def _rope(self, key_states: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``(B, T, d)`` of the new keys' positions."""
        b, _, t, _ = key_states.shape
        pos = _position_ids(kwargs)
        if pos is None or pos.shape[-1] != t:
            pos = torch.arange(self.cumulative_length, self.cumulative_length + t, device=key_states.device)
        pos = pos.reshape(-1, t).expand(b, t)
        cos, sin = self.rotary(key_states, pos)
        return cos.expand(b, t, -1), sin.expand(b, t, -1)

    def get_seq_length(self) -> int:
        """Tokens cached (quantized and full-precision)."""
        return self.cumulative_length

    def reset(self) -> None:
        """Forget everything."""
        super().reset()
        self.quantized_tokens = self.stored_bytes = 0
        self._deq_k = self._deq_v = self._cos = self._sin = None


class QuantizedKVCache(Cache):
    """A ``Cache`` of :class:`QuantizedKVLayer`, one per attention layer (created lazily); made
    by the ``nsnquant`` and ``kivi`` entries of kind ``kv-cache``
    (:func:`rankwise.compress.kv.make_cache`).

    Args:
        key_quantizer: Encodes/decodes chunks of keys (:class:`~rankwise.compress.kv.NSNQuant`,
            :class:`~rankwise.compress.kv.KIVI`).
        value_quantizer: The same for values.
        chunk: Tokens quantized together.
        rotary: The model's rotary embedding, for pre-RoPE key quantization (NSNQuant).
    """

    def __init__(self, key_quantizer: Any, value_quantizer: Any, chunk: int = 16,
                 rotary: torch.nn.Module | None = None) -> None:
        super().__init__(layer_class_to_replicate=lambda: QuantizedKVLayer(key_quantizer, value_quantizer,
                                                                           chunk, rotary))
        self.chunk = chunk

    def bytes_per_token(self) -> float:
        """Stored bytes per quantized token, keys and values of every layer, per sequence."""
        per_layer = []
        for layer in self.layers:
            if layer.quantized_tokens:
                batch = layer._deq_k.shape[0]
                per_layer.append(layer.stored_bytes / (layer.quantized_tokens * batch))
        return float(sum(per_layer))


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of the model's cache argument (``cache`` in transformers 5, else
    ``past_key_values``)."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


CacheFactory = Callable[[], Cache]
