"""The factorised KV cache of Tensor Product Attention.

Per layer and token it keeps the key and value factors, not the keys and values: ``A_K``
``(R_K, h)``, the pre-rotated ``B̃_K`` ``(R_K, d_h)``, ``A_V`` ``(R_V, h)`` and ``B_V``
``(R_V, d_h)``, i.e. ``(R_K + R_V)(h + d_h)`` numbers (paper Table 1) instead of MHA's
``2 h d_h``. Keys and values are rebuilt from them at every step (``K = A_Kᵀ B̃_K / R_K``).
A non-contextual ``A`` is a parameter, so only the ``B`` factors are cached.
"""
from __future__ import annotations

import torch


class TPACache:
    """Grows, per layer, the factor tensors of every token seen so far (batch-first:
    ``(batch, tokens, rank, width)``).

    It has what transformers' ``generate`` reads from a cache (``get_seq_length``,
    ``is_compileable``); the TPA model creates one when ``use_cache`` is set and returns it.

    Args:
        num_layers: Decoder layers of the model.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, num_layers: int) -> None:
        self.layers: list[tuple[torch.Tensor, ...] | None] = [None] * num_layers

    def update(self, layer: int, factors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Append this step's factors (each ``(B, T, R, w)``) to ``layer``'s and return all of them."""
        old = self.layers[layer]
        new = factors if old is None else tuple(torch.cat([o, f], dim=1) for o, f in zip(old, factors))
        self.layers[layer] = new
        return new

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached in ``layer_idx`` (0 before the first forward)."""
        entry = self.layers[layer_idx]
        return 0 if entry is None else int(entry[0].shape[1])

    def nbytes(self, layer: int | None = None) -> int:
        """Bytes held (one layer, or all)."""
        layers = self.layers if layer is None else [self.layers[layer]]
        return sum(t.numel() * t.element_size() for entry in layers if entry is not None for t in entry)

    def bytes_per_token(self, layer: int = 0) -> float:
        """Bytes per cached token (and batch row) of one layer."""
        entry = self.layers[layer]
        if entry is None:
            return 0.0
        return self.nbytes(layer) / (entry[0].shape[0] * entry[0].shape[1])


__all__ = ["TPACache"]
