"""The KV caches' configs, one per entry of registry kind ``kv-cache`` (torch only).

A cache is chosen as ``{name: ..., its keys}``: ``compress.kv_cache: {name: nsnquant, bits: 2}``
or ``decode.kv_cache: {name: kivi, bits: 4}`` (``rankwise generate --kv-cache kivi --kv-bits 4``).
Each class holds every default of its cache; the quantized ones also say which quantizers they
are made of (:meth:`NSNQuantCacheConfig.quantizers`), so the cache, its stored bits and its
tests never branch on a name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rankwise.compress.kv.quantizers import KIVI, NSNQuant
from rankwise.configs import KEY_HINTS, bounded

for _key in ("bits", "chunk"):  # a quantizer's key on the float cache: the fix, not "unknown key"
    KEY_HINTS[f"compress.kv_cache.{_key}"] = (
        f"the fp cache stores floats and has no {_key}; name a quantized cache "
        "(compress.kv_cache.name: nsnquant or kivi)")


@dataclass
class KVCacheConfig:
    """What every KV cache's config has.

    Attributes:
        name: The registered cache (``fp``, ``nsnquant``, ``kivi``; ``rankwise list``).
    """

    name: str = ""

    def quantizers(self, seed: int = 0) -> tuple[Any, Any] | None:
        """``(key quantizer, value quantizer)``; ``None``: the cache stores floats."""
        return None


@dataclass
class FPCacheConfig(KVCacheConfig):
    """``fp``: transformers' own full-precision cache (the reference). No settings."""

    name: str = "fp"


@dataclass
class NSNQuantCacheConfig(KVCacheConfig):
    """``nsnquant``: NSNQuant vector quantization, keys before RoPE (:class:`NSNQuant`).

    Attributes:
        bits: Bits per cached element: 1 or 2 (one 256-entry codebook per width).
        chunk: Tokens quantized together; the newest incomplete chunk stays full precision.
    """

    name: str = "nsnquant"
    bits: int = bounded(2, ge=1, le=2, hint="(NSNQuant has 1- and 2-bit codebooks)")
    chunk: int = bounded(16, ge=1)

    def quantizers(self, seed: int = 0) -> tuple[Any, Any]:
        """One :class:`NSNQuant` for keys and values (``seed``: its synthetic codebook's)."""
        q = NSNQuant(self.bits, seed)
        return q, q


@dataclass
class KIVICacheConfig(KVCacheConfig):
    """``kivi``: KIVI's uniform quantization, keys per channel, values per token (:class:`KIVI`).

    Attributes:
        bits: Bits per cached element, 1 to 8.
        chunk: Tokens quantized together (KIVI's group of tokens); the newest incomplete chunk
            stays full precision.
    """

    name: str = "kivi"
    bits: int = bounded(2, ge=1, le=8)
    chunk: int = bounded(16, ge=1)

    def quantizers(self, seed: int = 0) -> tuple[Any, Any]:
        """:class:`KIVI` per channel for keys, per token for values (no randomness)."""
        return KIVI(self.bits, per_channel=True), KIVI(self.bits, per_channel=False)


__all__ = ["FPCacheConfig", "KIVICacheConfig", "KVCacheConfig", "NSNQuantCacheConfig"]
