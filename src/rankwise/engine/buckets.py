"""Length buckets: under ``train.compile`` every batch is right-padded to one of a few lengths,
so a run compiles one graph per bucket instead of one per new length.

The padding is masked: input ids take the data's ``pad_id``, ``attention_mask`` 0, ``labels``
-100 and ``token_weights`` 0, so a padded batch has the same targets, tokens and loss as the
unpadded one (up to float rounding of the longer reductions). Right padding adds positions
*after* every real token; a causal model's real tokens never attend to them. Packed blocks
(``data.packing``) all have ``data.max_length`` tokens, the largest bucket: one graph.

Only ``(B, T)`` tensors are padded (a classification batch's ``labels`` ``(B,)`` stays). A batch
is a group of ``(B, T)`` tensors per prefix (``input_ids``; KTO also ``kl_input_ids``).
A batch carrying another tensor whose second dimension follows ``T`` (memory-decoder's
``knn_ids`` ``(B, T-1, K)``) is left as it is: its padding is the task's own business.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from rankwise.engine.task import IGNORE

MIN_BUCKET = 64  # the smallest power-of-two bucket (TrainConfig.compile_buckets: pow2)
PAD_VALUES = {"attention_mask": 0, "labels": IGNORE, "token_weights": 0}  # input_ids: pad_id


def bucket_lengths(spec: Union[str, int, Sequence[int]], max_length: int) -> tuple[int, ...]:
    """The bucket lengths of ``train.compile_buckets`` for data cut at ``max_length``.

    Args:
        spec: ``"pow2"`` (64, 128, 256, ... below ``max_length``, then ``max_length``), an
            integer ``k`` (the multiples of ``k`` below ``max_length``, then ``max_length``),
            ``0`` (no buckets), or a list of lengths (``max_length`` added when missing).
        max_length: ``data.max_length``: the longest batch the data makes.

    Returns:
        The lengths, ascending; ``()`` for no buckets.
    """
    if spec == "pow2":
        out, n = [], MIN_BUCKET
        while n < max_length:
            out.append(n)
            n *= 2
    elif isinstance(spec, int):
        if spec <= 0:
            return ()
        out = list(range(spec, max_length, spec))
    else:
        out = [int(n) for n in spec if 0 < int(n) < max_length]
    return tuple(sorted(set(out) | {int(max_length)}))


def bucket_for(width: int, lengths: Sequence[int]) -> int:
    """The smallest bucket that holds ``width`` tokens (``width`` itself past the largest)."""
    return next((n for n in lengths if n >= width), width)


def pad_to_bucket(batch: dict[str, torch.Tensor], lengths: Sequence[int], pad_id: int
                  ) -> dict[str, torch.Tensor]:
    """``batch`` right-padded to its bucket (see the module docstring).

    Args:
        batch: A collated batch.
        lengths: :func:`bucket_lengths` (empty: the batch is returned as it is).
        pad_id: The data's padding token.

    Returns:
        A new dict with the padded tensors (the others shared), or ``batch`` itself when there
        are no buckets, it already has a bucket's length, or it holds a tensor this function
        cannot pad.
    """
    prefixes = [k[: -len("input_ids")] for k in batch if k.endswith("input_ids")]
    if not lengths or not prefixes:
        return batch
    widths = {p: batch[p + "input_ids"].shape[1] for p in prefixes}
    known = {p + s for p in prefixes for s in ("input_ids", "position_ids", *PAD_VALUES)}
    for key, value in batch.items():  # a tensor that follows T under another name: leave it
        if key not in known and value.dim() >= 2 and any(value.shape[1] in (t - 1, t) for t in widths.values()):
            return batch
    out = dict(batch)
    for p, width in widths.items():
        extra = bucket_for(width, lengths) - width
        if extra <= 0:
            continue
        for suffix, value in (("input_ids", pad_id), *PAD_VALUES.items()):
            t = batch.get(p + suffix)
            if t is not None and t.dim() == 2 and t.shape[1] == width:  # not a class label (B,)
                out[p + suffix] = torch.cat([t, t.new_full((t.shape[0], extra), value)], dim=1)  # (B, T')
        if p + "position_ids" in batch:
            out[p + "position_ids"] = _more_positions(batch[p + "position_ids"],
                                                      batch.get(p + "attention_mask"), extra)
    return out if any(out[k] is not batch[k] for k in batch) else batch


def _more_positions(pos: torch.Tensor, mask: torch.Tensor | None, extra: int) -> torch.Tensor:
    """``pos`` (B, T) extended by ``extra`` columns: a row ending in padding continues its
    padding segment, a full row starts a new one at 0 (as ``collate`` numbers a padding tail)."""
    ends_padded = (mask[:, -1:] == 0) if mask is not None else torch.zeros_like(pos[:, -1:], dtype=torch.bool)
    start = torch.where(ends_padded, pos[:, -1:] + 1, torch.zeros_like(pos[:, -1:]))   # (B, 1)
    return torch.cat([pos, start + torch.arange(extra, dtype=pos.dtype, device=pos.device)], dim=1)


__all__ = ["MIN_BUCKET", "bucket_for", "bucket_lengths", "pad_to_bucket"]
