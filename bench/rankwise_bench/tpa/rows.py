"""The rows of ``bench tpa`` and the paper's head-count rule.

Every row gets MHA's attention parameters, ``4 d²`` (``W_Q, W_K, W_V, W_O``), by choosing its
head count (paper §6, "we adjust the number of heads so that the attention parameters match";
Appendix H's medium configs are MHA 16, MQA 31, GQA 30, TPA 47, TPA-KVonly 29 heads at
``d = 1024, d_h = 64``, which :func:`matched_heads` reproduces). Per row, attention parameters
per layer:

* GQA with ``G`` KV heads (MHA: ``G = h``; MQA: ``G = 1``): ``2 d h d_h + 2 d G d_h``
* TPA: ``d [(R_Q + R_K + R_V)(h + d_h) + h d_h]``
* TPA-KVonly: ``d [2 h d_h + (R_K + R_V)(h + d_h)]``
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sizes:
    """Everything that sets the benchmark's size (defaults: a one-core CPU run of a few minutes).

    Attributes:
        hidden, layers, intermediate, head_dim: The Llama shape every row shares (the MLP and
            ``d_h`` are the same; only the attention's heads and factors differ).
        q_rank, k_rank, v_rank: TPA's ranks (the paper's ``R_Q = 6, R_K = R_V = 2``).
        gqa_groups: KV heads of the GQA row.
        seq, batch, steps: Bytes per window, windows per step, optimizer steps (equal tokens).
        lrs: AdamW's peak learning rates (10% warm-up, cosine to 10%); every row trains at each
            and reports its best held-out loss.
        eval_windows: Held-out windows for the final loss.
        prompt, new_tokens, decode_rounds: Decoding speed: a ``prompt``-byte held-out prompt,
            ``new_tokens`` greedy tokens with the cache, ``decode_rounds`` interleaved rounds.
        threads: torch intra-op threads.
        seed: Seed of the initial weights, the windows and the batch order.
    """

    hidden: int = 128
    layers: int = 2
    intermediate: int = 344
    head_dim: int = 32
    q_rank: int = 6
    k_rank: int = 2
    v_rank: int = 2
    gqa_groups: int = 2
    seq: int = 128
    batch: int = 16
    steps: int = 120
    lrs: tuple[float, ...] = (3e-3, 1e-2)
    eval_windows: int = 64
    prompt: int = 32
    new_tokens: int = 128
    decode_rounds: int = 3
    threads: int = 1
    seed: int = 0


ROWS = ("mha", "gqa", "mqa", "tpa", "tpa-kvonly")


def matched_heads(row: str, d: int, dh: int, q_rank: int = 6, k_rank: int = 2, v_rank: int = 2,
                  groups: int = 2) -> int:
    """Heads that give ``row`` MHA's ``4 d²`` attention parameters (nearest integer).

    Args:
        row: One of :data:`ROWS`.
        d: Model width.
        dh: Head width ``d_h``.
        q_rank, k_rank, v_rank: TPA ranks.
        groups: GQA's KV heads.

    Returns:
        The head count ``h``.
    """
    if row == "mha":
        return d // dh
    if row in ("gqa", "mqa"):      # 2 d h dh + 2 d G dh = 4 d²
        g = groups if row == "gqa" else 1
        return round(2 * d / dh - g)
    r = k_rank + v_rank
    if row == "tpa":               # (R_Q + R_K + R_V)(h + dh) + h dh = 4 d
        return round((4 * d - (q_rank + r) * dh) / (q_rank + r + dh))
    if row == "tpa-kvonly":        # 2 h dh + (R_K + R_V)(h + dh) = 4 d
        return round((4 * d - r * dh) / (2 * dh + r))
    raise ValueError(f"row {row!r}: expected one of {ROWS}")


def kv_formula(row: str, heads: int, dh: int, k_rank: int, v_rank: int, groups: int) -> int:
    """Cached numbers per token per layer (paper Table 1)."""
    if row.startswith("tpa"):
        return (k_rank + v_rank) * (heads + dh)
    return 2 * {"mha": heads, "gqa": groups, "mqa": 1}[row] * dh


__all__ = ["ROWS", "Sizes", "kv_formula", "matched_heads"]
