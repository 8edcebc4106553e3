"""Compact storage is exact and sized as claimed."""
import math

import pytest
import torch

from rankwise.compress.formats import (decode_sparse, decode_uniform, encode_sparse, encode_uniform,
                                       pack_bits, sparse_keep, unpack_bits)
from rankwise.compress.pattern import check_pattern, keep_mask


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_bits_round_trip_and_size(bits):
    codes = torch.randint(0, 2 ** bits, (1003,))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(1003 * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, 1003), codes)


@pytest.mark.parametrize("nm", [None, (2, 4), (1, 4), (3, 8)])
def test_sparse_round_trip_is_exact(nm):
    w = torch.randn(12, 32)
    keep = keep_mask(w.abs(), 0.5, nm)
    tensors = encode_sparse(w, keep, nm, torch.float32)
    dense = decode_sparse(tensors, (12, 32), nm)
    assert torch.equal(dense, w * keep)
    assert torch.equal(sparse_keep(tensors, (12, 32), nm), keep)
    kept = int(keep.sum())
    assert tensors["values"].numel() == kept
    meta = tensors["mask"].numel() if nm is None else tensors["index"].numel()
    assert meta == (math.ceil(12 * 32 / 8) if nm is None else math.ceil(kept * math.ceil(math.log2(nm[1])) / 8))
    if nm:
        assert check_pattern(dense, nm)


def test_keep_mask_counts_are_exact():
    s = torch.rand(7, 24)
    assert int(keep_mask(s, 0.3, None, "layer").sum()) == round(0.7 * 7 * 24)
    assert (keep_mask(s, 0.5, None, "row").sum(1) == 12).all()
    assert (keep_mask(s, 0.0, (2, 4)).reshape(7, 6, 4).sum(-1) == 2).all()


def test_uniform_round_trip_is_exact():
    codes = torch.randint(0, 16, (5, 40)).float()
    scales, zeros = torch.rand(5, 2).half().float(), torch.randint(0, 16, (5, 2)).float()
    tensors = encode_uniform(codes, scales, zeros, 4)
    col = torch.arange(40) // 32
    assert torch.equal(decode_uniform(tensors, (5, 40), 4, 32), (codes - zeros[:, col]) * scales[:, col])
