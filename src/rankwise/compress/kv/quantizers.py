"""KV-cache quantizers on ``(batch, heads, tokens, head_dim)`` chunks: NSNQuant and KIVI.

A quantizer turns a chunk of keys or values into a small dict of tensors (``encode``), back
(``decode``), and says how many bytes the dict holds (``nbytes``). Codes are counted at their
bit width: NSNQuant's are byte-sized indices already; KIVI's b-bit codes are held one per byte
here and counted as ``b`` bits, which is what packing them would store.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

SUBVECTOR = 8          # NSNQuant quantizes 8-dimensional subvectors
CODEBOOK_SIZE = 256    # one uint8 index per subvector


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of order ``n`` (a power of two)."""
    assert n >= 1 and n & (n - 1) == 0, "Hadamard order must be a power of two"
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@lru_cache(maxsize=4)
def codebook(kind: str, seed: int = 0, samples: int = 1 << 15, iters: int = 20) -> torch.Tensor:
    """The shared, calibration-free codebook on the unit sphere: spherical k-means (assign by
    the largest cosine, centroid = normalized mean) of synthetic ``N(0, I_8)`` samples projected
    onto the sphere (``kind="signed"``, the 1-bit book) or of their absolute values
    (``kind="magnitude"``, the 2-bit book used with a separate sign mask, so its entries lie in
    the positive orthant).

    After the NSN transform every 8-dimensional subvector is a Gaussian direction times a norm
    the decoder restores from ``‖token‖ = √d``; only the direction is coded, so the entries are
    unit vectors and the match is by cosine (the unit-norm, cosine-matched codebook of NSNQuant as
    the notes record it; the Euclidean k-means used before
    this change spent codewords on the norm of a subvector).

    Returns:
        ``(256, 8)`` float32 unit-norm centroids (deterministic for a seed).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, SUBVECTOR, generator=g)
    if kind == "magnitude":
        x = x.abs()
    x = x / x.norm(dim=1, keepdim=True).clamp(min=1e-12)
    cents = x[torch.randperm(samples, generator=g)[:CODEBOOK_SIZE]].clone()
    for _ in range(iters):
        assign = _nearest(x, cents)
        sums = torch.zeros_like(cents).index_add_(0, assign, x)
        norms = sums.norm(dim=1, keepdim=True)
        cents = torch.where(norms > 0, sums / norms.clamp(min=1e-12), cents)
    return cents


def _nearest(x: torch.Tensor, cents: torch.Tensor) -> torch.Tensor:
    """Index of the centroid of largest cosine with each row of ``x`` (centroids unit norm)."""
    return torch.argmax(x @ cents.T, dim=1)


class NSNQuant:
    """NSNQuant (arXiv 2505.18231), calibration-free vector quantization of KV caches: per
    token and head, **N**ormalize (``x₁ = x / s₁``, ``s₁ = ‖x‖/√d``), **S**hift (subtract the
    chunk's channel mean ``o`` of ``x₁``), **N**ormalize again (``s₂``), rotate by a Hadamard
    matrix, which leaves each token close to ``N(0, I)`` with norm ``√d``; then quantize every
    8-dimensional subvector with ONE codebook per bit width that never saw real data:

    * 1 bit: an index into a 256-entry codebook (8 bits / 8 elements);
    * 2 bits: an 8-bit sign mask plus an index into a 256-entry codebook of magnitudes.

    Decoding looks the entries up, rescales the token back to norm ``√d``, rotates back and
    undoes the shift and the two scales. ``s₁, s₂`` (per token) and ``o`` (per chunk, channel)
    are stored in float16.

    Keys are quantized **before** RoPE, as in the paper: the cache (:class:`QuantizedKVLayer`)
    undoes the rotation of the keys it receives, quantizes, and applies RoPE again to the
    dequantized keys (``pre_rope``). The codebook lies on the unit sphere and is matched by
    cosine (:func:`codebook`).

    Choices where the sources leave room (see ``docs/compression.md``): the codebook is
    spherical k-means of synthetic samples, not fine-tuned by gradient descent; metadata stays
    float16 (no 4-bit double quantization), so the stored bits per element exceed the nominal
    ``bits`` by ``32/d + 16/chunk`` (:meth:`bits_per_element`: 2.25 for "1 bit" at ``d = 128``,
    chunk 16).

    Args:
        bits: 1 or 2.
        seed: Seed of the synthetic codebook samples.
    """

    pre_rope = True

    def __init__(self, bits: int, seed: int = 0) -> None:
        assert bits in (1, 2)
        self.bits = bits
        self.book = codebook("signed" if bits == 1 else "magnitude", seed)
        self._had: dict[int, torch.Tensor] = {}

    def _rot(self, d: int, like: torch.Tensor) -> torch.Tensor:
        if d not in self._had:
            self._had[d] = hadamard(d)
        return self._had[d].to(like.device, like.dtype)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize a chunk ``(B, H, T, d)``; ``d`` must be a power of two >= 8."""
        d = x.shape[-1]
        x = x.float()
        s1 = (x.norm(dim=-1, keepdim=True) / math.sqrt(d)).clamp(min=1e-8).half()
        x1 = x / s1.float()
        o = x1.mean(dim=-2, keepdim=True).half()                              # (B, H, 1, d)
        x2 = x1 - o.float()
        s2 = (x2.norm(dim=-1, keepdim=True) / math.sqrt(d)).clamp(min=1e-8).half()
        y = (x2 / s2.float()) @ self._rot(d, x)                               # (B, H, T, d)
        sub = y.reshape(-1, SUBVECTOR)
        book = self.book.to(x.device)
        out = {"s1": s1, "s2": s2, "o": o}
        if self.bits == 1:
            out["index"] = _nearest(sub, book).to(torch.uint8)
        else:
            signs = (sub < 0).to(torch.int64)
            out["sign"] = (signs << torch.arange(SUBVECTOR, device=x.device)).sum(1).to(torch.uint8)
            out["index"] = _nearest(sub.abs(), book).to(torch.uint8)
        return out

    def decode(self, q: dict[str, torch.Tensor]) -> torch.Tensor:
        """The chunk back, ``(B, H, T, d)`` float32."""
        s1, s2, o = q["s1"].float(), q["s2"].float(), q["o"].float()
        d = o.shape[-1]
        sub = self.book.to(o.device)[q["index"].long()]                       # (n, 8)
        if self.bits == 2:
            bits = (q["sign"].long()[:, None] >> torch.arange(SUBVECTOR, device=o.device)) & 1
            sub = sub * (1 - 2 * bits)
        y = sub.reshape(*s1.shape[:-1], d)
        y = y * (math.sqrt(d) / y.norm(dim=-1, keepdim=True).clamp(min=1e-8))
        return s1 * (s2 * (y @ self._rot(d, y).T) + o)

    def nbytes(self, q: dict[str, torch.Tensor]) -> int:
        """Bytes of the encoded chunk."""
        return sum(t.numel() * t.element_size() for t in q.values())

    def bits_per_element(self, head_dim: int, chunk: int) -> float:
        """Stored bits per cached element, metadata included: one 8-bit index (and at 2 bits an
        8-bit sign mask) per 8 elements, ``s₁, s₂`` float16 per token and head, ``o`` float16
        per channel and chunk: ``bits + 32/head_dim + 16/chunk``."""
        return self.bits + 32 / head_dim + 16 / chunk


class KIVI:
    """KIVI-style uniform quantization (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit
    Quantization for KV Cache", ICML 2024): keys per channel (min-max over the chunk's tokens),
    values per token (min-max over the head dimension), asymmetric, ``bits`` bits; the minimum
    and the step are stored in float16. The chunk plays the role of KIVI's group of tokens.

    Args:
        bits: 1 to 8.
        per_channel: ``True`` for keys, ``False`` for values.
    """

    pre_rope = False

    def __init__(self, bits: int, per_channel: bool) -> None:
        self.bits, self.per_channel = bits, per_channel

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize a chunk ``(B, H, T, d)``."""
        dim = -2 if self.per_channel else -1
        x = x.float()
        lo = x.amin(dim=dim, keepdim=True).half()
        step = ((x.amax(dim=dim, keepdim=True) - lo.float()) / (2 ** self.bits - 1)).clamp(min=1e-8).half()
        codes = torch.clamp(torch.round((x - lo.float()) / step.float()), 0, 2 ** self.bits - 1)
        return {"codes": codes.to(torch.uint8), "min": lo, "step": step}

    def decode(self, q: dict[str, torch.Tensor]) -> torch.Tensor:
        """``code · step + min``, float32."""
        return q["codes"].float() * q["step"].float() + q["min"].float()

    def nbytes(self, q: dict[str, torch.Tensor]) -> int:
        """Codes at ``bits`` each plus the float16 minima and steps."""
        return math.ceil(q["codes"].numel() * self.bits / 8) + 2 * (q["min"].numel() + q["step"].numel())

    def bits_per_element(self, head_dim: int, chunk: int) -> float:
        """Stored bits per element: ``bits`` plus a float16 minimum and step per group, a group
        being ``chunk`` tokens of one channel (keys) or the ``head_dim`` channels of one token
        (values): ``bits + 32/chunk`` or ``bits + 32/head_dim``."""
        return self.bits + 32 / (chunk if self.per_channel else head_dim)
