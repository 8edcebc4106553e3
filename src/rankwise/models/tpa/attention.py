"""Tensor Product Attention (Zhang et al., 2025, "Tensor Product Attention Is All You Need").

Per token ``x_t`` the queries, keys and values of all heads are sums of rank-one tensor
products of a head factor and a token-dimension factor (Eq. 3.1)::

    Q_t = (1/R_Q) Σ_r a_r^Q(x_t) ⊗ b_r^Q(x_t) = (1/R_Q) A_Q(x_t)ᵀ B_Q(x_t) ∈ R^{h × d_h}
    A_Q(x) = reshape(W_A^Q x) ∈ R^{R_Q × h},   B_Q(x) = reshape(W_B^Q x) ∈ R^{R_Q × d_h}

and likewise K (rank ``R_K``) and V (``R_V``). RoPE acts on the ``d_h`` axis only, so it is
applied to the rows of ``B`` before the product (Theorem 3.1: ``RoPE(A ᵀB)/R = A ᵀ RoPE(B)/R``),
and the cache stores ``A`` and the pre-rotated ``B̃`` (:mod:`.cache`). TPA-KVonly keeps an ordinary
query projection. Attention itself is standard scaled dot-product attention, then ``W_O``.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.models.tpa.cache import TPACache


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(-x2, x1)`` for the halves of the last axis (Llama's RoPE convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, T, n, d_h)`` by the angles of its tokens (``cos``/``sin``: ``(B, T, d_h)``)."""
    return x * cos.unsqueeze(2) + rotate_half(x) * sin.unsqueeze(2)


class Factor(nn.Module):
    """One factorised projection: ``x -> (A (B, T, R, h), B (B, T, R, d_h))``.

    ``A`` is ``W_A x`` reshaped, or with ``contextual_a=False`` a learned ``(R, h)`` constant
    shared by every token.
    """

    def __init__(self, hidden: int, heads: int, head_dim: int, rank: int, contextual_a: bool = True) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rank = heads, head_dim, rank
        if contextual_a:
            self.a_proj = nn.Linear(hidden, rank * heads, bias=False)
        else:
            self.a_const = nn.Parameter(torch.zeros(rank, heads))
        self.b_proj = nn.Linear(hidden, rank * head_dim, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        if hasattr(self, "a_proj"):
            a = self.a_proj(x).view(b, t, self.rank, self.heads)        # (B, T, R, h)
        else:
            a = self.a_const.to(x.dtype).expand(b, t, self.rank, self.heads)
        return a, self.b_proj(x).view(b, t, self.rank, self.head_dim)   # (B, T, R, d_h)


def tensor_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(1/R) Aᵀ B`` per token: ``(B, T, R, h)`` and ``(B, T, R, d_h)`` -> ``(B, h, T, d_h)``."""
    return torch.einsum("btrh,btrd->bhtd", a, b) / a.shape[2]


class TPAttention(nn.Module):
    """Tensor Product Attention (paper Eq. 3.1-3.3; Theorem 3.1 for RoPE), or TPA-KVonly.

    Args:
        hidden: Model width ``d``.
        heads: Heads ``h``.
        head_dim: ``d_h``.
        q_rank: ``R_Q`` (ignored when ``kv_only``).
        k_rank: ``R_K``.
        v_rank: ``R_V``.
        kv_only: Queries from an ordinary ``d -> h d_h`` projection (the paper's TPA-KVonly).
        contextual_a: ``False``: ``A`` factors are learned constants (non-contextual TPA).
        layer_idx: This layer's slot in a :class:`~rankwise.models.tpa.cache.TPACache`.
    """

    def __init__(self, hidden: int, heads: int, head_dim: int, q_rank: int, k_rank: int, v_rank: int,
                 kv_only: bool = False, contextual_a: bool = True, layer_idx: int = 0) -> None:
        super().__init__()
        self.heads, self.head_dim, self.layer_idx, self.kv_only = heads, head_dim, layer_idx, kv_only
        if kv_only:
            self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        else:
            self.q = Factor(hidden, heads, head_dim, q_rank, contextual_a)
        self.k = Factor(hidden, heads, head_dim, k_rank, contextual_a)
        self.v = Factor(hidden, heads, head_dim, v_rank, contextual_a)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotated queries ``(B, h, T, d_h)``: RoPE on ``B_Q`` before the product (Theorem 3.1)."""
        if self.kv_only:
            b, t, _ = x.shape
            q = apply_rope(self.q_proj(x).view(b, t, self.heads, self.head_dim), cos, sin)
            return q.transpose(1, 2)
        a, bq = self.q(x)
        return tensor_product(a, apply_rope(bq, cos, sin))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, cache: TPACache | None = None) -> torch.Tensor:
        """Attend.

        Args:
            x: ``(B, T, d)`` hidden states of the new tokens.
            cos, sin: ``(B, T, d_h)`` RoPE angles of their positions.
            mask: Boolean ``(B, 1, T, S)`` (True = attend) over all ``S`` cached + new tokens;
                ``None``: causal over the new tokens alone (no cache before them).
            cache: Factors of earlier tokens; this step's are appended.

        Returns:
            ``(B, T, d)``.
        """
        b, t, _ = x.shape
        q = self.queries(x, cos, sin)                                   # (B, h, T, d_h)
        ak, bk = self.k(x)
        av, bv = self.v(x)
        factors = (ak, apply_rope(bk, cos, sin), av, bv)                # B̃_K is cached rotated
        if cache is not None:
            if not hasattr(self.k, "a_proj"):                            # constant A: cache B only
                bk_all, bv_all = cache.update(self.layer_idx, factors[1::2])
                s = bk_all.shape[1]
                factors = (ak[:, :1].expand(b, s, -1, -1), bk_all, av[:, :1].expand(b, s, -1, -1), bv_all)
            else:
                factors = cache.update(self.layer_idx, factors)
        k = tensor_product(factors[0], factors[1])                      # (B, h, S, d_h)
        v = tensor_product(factors[2], factors[3])
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


__all__ = ["TPAttention", "Factor", "apply_rope", "rotate_half", "tensor_product"]
