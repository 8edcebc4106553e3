"""Packing: several causal-LM examples per ``max_length`` block, none attending to another.

A packed block carries ``position_ids`` that restart at 0 for every example; the task then
calls the model without an attention mask and with ``use_cache=False``, and transformers
(``masking_utils.find_packed_sequence_indices``) turns the restarts into a block-diagonal causal
mask. Each example's first token gets label ``-100`` (unpacked, it is never predicted), so a
packed step has exactly the loss terms of the unpacked one. :func:`check_packed_attention`
verifies, once per run, that the model honours this (else attention would cross examples).

Blocks are filled best-fit-decreasing over the examples' lengths (a plain Python loop over a
sorted list of open capacities): no Python object per example or per block is kept, only
integer arrays (the open blocks of each remaining capacity are a stack linked through one
array of block numbers).
"""
from __future__ import annotations

import bisect
from array import array
from typing import Any

import numpy as np
import torch
from torch import nn

from rankwise.data.formats import IGNORE
from rankwise.errors import RankwiseError


def pack(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Assign examples to blocks of at most ``capacity`` tokens (best fit, longest first).

    Args:
        lengths: Tokens per example (each ``<= capacity``; zeros are skipped).
        capacity: Tokens per block.

    Returns:
        ``(order, starts)``: block ``b`` holds examples ``order[starts[b]:starts[b + 1]]``
        (in their original relative order).
    """
    lengths = np.asarray(lengths)
    assert lengths.max(initial=0) <= capacity, "examples are truncated before packing"
    by_length = np.argsort(-lengths.astype(np.int64), kind="stable")
    block = np.full(len(lengths), -1, dtype=np.int64)
    caps: list[int] = []            # sorted remaining capacities that have an open block
    top = [-1] * (capacity + 1)     # per remaining capacity: the block last left with it (-1: none)
    under = array("q")              # per block: the block below it in its capacity's stack
    n_blocks = 0
    step = 65536                    # bounded: no list of every example
    for k in range(0, len(by_length), step):
        ids = by_length[k:k + step]
        assigned = [-1] * len(ids)
        for j, need in enumerate(lengths[ids].tolist()):
            if need == 0:
                continue
            c = bisect.bisect_left(caps, need)
            if c == len(caps):
                b, left = n_blocks, capacity - need
                n_blocks += 1
                under.append(-1)
            else:
                cap = caps[c]
                b = top[cap]
                top[cap] = under[b]
                if top[cap] < 0:
                    del caps[c]
                left = cap - need
            assigned[j] = b
            if left > 0:
                if top[left] < 0:
                    bisect.insort(caps, left)
                under[b] = top[left]
                top[left] = b
        block[ids] = assigned
    skipped = int(np.count_nonzero(block < 0))
    order = np.argsort(block, kind="stable")[skipped:]   # by block, each in original order
    starts = np.concatenate([[0], np.cumsum(np.bincount(block[order], minlength=n_blocks))])
    return order, starts


class PackedData:
    """Training examples of ``data`` packed into blocks (the engine indexes blocks).

    Args:
        data: An :class:`~rankwise.data.text.ArrowData` (or anything with ``lengths()`` and
            ``rows(indices)``).
        capacity: Tokens per block (``data.max_length``).

    Attributes:
        pad_id, label_names, labels: As the wrapped data (``labels`` is ``None``).
    """

    def __init__(self, data: Any, capacity: int) -> None:
        self.data, self.capacity = data, capacity
        self.pad_id, self.label_names, self.labels = data.pad_id, data.label_names, None
        self.dropped = getattr(data, "dropped", 0)
        self.order, self.starts = pack(data.lengths(), capacity)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, b: int) -> dict[str, list[int]]:
        """Block ``b``: ``input_ids``, ``labels`` and restarting ``position_ids``."""
        rows = self.data.rows(self.order[self.starts[b]:self.starts[b + 1]].tolist())
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for row in rows:
            own = row.get("labels") or row["input_ids"]
            ids += row["input_ids"]
            labels += [IGNORE] + list(own[1:])   # the first token is never predicted
            positions += range(len(row["input_ids"]))
        return {"input_ids": ids, "labels": labels, "position_ids": positions}

    def tokens(self) -> int:
        """Real tokens over all blocks."""
        return int(self.data.lengths().sum())


def check_packed_attention(model: nn.Module, device: str = "cpu") -> None:
    """Check that ``model`` keeps packed examples apart (restarting ``position_ids``).

    Runs two short random sequences packed and unpacked through ``model`` (eval mode, no grad)
    and compares the second one's logits.

    Raises:
        RankwiseError: If attention crosses the example boundary (the architecture does not
            derive a block mask from ``position_ids``).
    """
    was = model.training
    model.eval()
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 2) or 2)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(1, max(2, vocab), (1, 5), generator=g).to(device)
    b = torch.randint(1, max(2, vocab), (1, 4), generator=g).to(device)
    try:
        with torch.no_grad():
            alone = model(input_ids=b, use_cache=False).logits
            pos = torch.cat([torch.arange(5), torch.arange(4)]).unsqueeze(0).to(device)
            packed = model(input_ids=torch.cat([a, b], 1), position_ids=pos, use_cache=False).logits
    finally:
        model.train(was)
    if not torch.allclose(packed[:, 5:].float(), alone.float(), atol=1e-3, rtol=1e-3):
        raise RankwiseError(f"{type(model).__name__} lets packed examples attend to each other "
                            "(it ignores restarting position_ids); set data.packing: false")


def packed_training_data(model: nn.Module, data: Any, capacity: int, device: str = "cpu") -> PackedData:
    """Pack ``data`` for training ``model``, after checking the model keeps examples apart.

    Raises:
        RankwiseError: If the model has input adapters that add virtual tokens (they would
            prefix a whole block, not each example) or lets packed examples attend to each other.
    """
    from rankwise.core.protocol import input_adapters
    if any(a.virtual_tokens() for a in input_adapters(model)):  # LoPE's noise adds none
        raise RankwiseError("data.packing cannot be combined with a method that adds virtual "
                            "tokens (they would prefix a whole block); set data.packing: false")
    check_packed_attention(model, device)
    return PackedData(data, capacity)


__all__ = ["pack", "PackedData", "check_packed_attention", "packed_training_data"]
