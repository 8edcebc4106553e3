"""GLVQ: Babai re-encoding of the decoded weights returns the stored codes, the codes cost
exactly ``bits`` per weight, and the learned lattice beats scalar rounding at low bits."""
import pytest
import torch

from rankwise.compress.base import relative_error
from rankwise.compress.glvq.lattice import compand, expand

from compress_helpers import compressor, problem


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("companding", [True, False])
def test_round_trip_is_exact_for_the_stored_codes(bits, companding):
    w, h = problem(32, 64)
    comp = compressor("glvq", bits=bits, group_size=32, companding=companding, rounds=2, steps=3)
    out = comp.compress(w.clone(), h)
    codes = comp.codes(out.tensors, (32, 64))
    assert int(codes.min()) >= -(2 ** (bits - 1)) and int(codes.max()) <= 2 ** (bits - 1) - 1
    assert torch.equal(comp.encode_weight(out.tensors, comp.decode(out.tensors, (32, 64))), codes)
    assert out.tensors["codes"].numel() == 32 * 64 * bits // 8
    assert out.tensors["generators"].shape == (2, 8, 8) and out.tensors["generators"].dtype == torch.float16


def test_decode_is_one_small_matmul_per_vector():
    w, h = problem(16, 32)
    comp = compressor("glvq", bits=3, group_size=32, companding=False, rounds=1, steps=1)
    t = comp.compress(w.clone(), h).tensors
    z = comp.codes(t, (16, 32))                                    # (groups, vectors, d)
    by_hand = t["scales"].float()[:, None, None] * ((z + 0.5) @ t["generators"].float().transpose(1, 2))
    assert torch.allclose(comp.decode(t, (16, 32)), by_hand.reshape(16, 32), atol=0, rtol=0)


def test_companding_inverts():
    x = torch.linspace(-1, 1, 101)
    for mu in (0.01, 10.0, 255.0):
        assert torch.allclose(expand(compand(x, torch.tensor(mu)), torch.tensor(mu)), x, atol=1e-6)


def test_the_best_iterate_is_kept_and_learning_helps():
    w, h = problem(64, 128)
    out = compressor("glvq", bits=3, group_size=64, rounds=4, steps=10).compress(w.clone(), h)
    hist = out.info["group_error"]
    assert all(b <= a for a, b in zip(hist, hist[1:])) and hist[-1] < hist[0]


def test_two_bit_lattice_beats_round_to_nearest():
    w, h = problem(64, 256)
    glvq = relative_error(w, compressor("glvq", bits=2).compress(w.clone(), h).weight, h)
    rtn = relative_error(w, compressor("rtn", bits=2).compress(w.clone(), h).weight, h)
    assert glvq < 0.7 * rtn, (glvq, rtn)
