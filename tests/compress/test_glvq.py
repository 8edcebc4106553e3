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


# ----- issue 27 item 6: salience allocation, the pull towards G⁽⁰⁾, μ in [10, 255] ---------
def test_allocation_by_hand():
    from rankwise.compress.glvq.lattice import allocate
    sal = torch.tensor([4.0, 1.0, 3.0, 2.0])                 # ranking: g0, g2, g3, g1
    errors = {1: torch.tensor([10.0, 2.0, 6.0, 2.0]), 2: torch.tensor([4.0, 1.0, 2.0, 1.5]),
              3: torch.tensor([1.0, 0.6, 0.5, 0.8])}
    # k=0: 8.5; k=1: 8.5 + (1 - 4) + (2 - 1) = 6.5; k=2: 8.5 + (1 - 4) + (0.5 - 2) + (2 - 1) + (2 - 1.5) = 5.5
    assert allocate(sal, errors, 2).tolist() == [3, 1, 3, 1]
    # when mixing does not pay (equal groups, convex error in bits) it stays uniform
    flat = {1: torch.full((4,), 4.0), 2: torch.full((4,), 1.0), 3: torch.full((4,), 0.25)}
    assert allocate(sal, flat, 2).tolist() == [2, 2, 2, 2]


def _salient_problem():
    """A 64×512 layer, 8 groups of 64 columns, the first four with 10× larger weights."""
    w, h = problem(64, 512)
    w = w.clone()
    w[:, :256] *= 10
    return w, h


def test_salience_allocation_keeps_the_average_and_favours_salient_groups():
    from rankwise.compress.glvq.lattice import salience
    w, h = _salient_problem()
    comp = compressor("glvq", bits=2, group_size=64)
    out = comp.compress(w.clone(), h)
    gb = out.info["group_bits"]
    sal = salience(w, h).reshape(64, 8, 64).sum((0, 2))
    assert sum(gb) == 2 * 8                                  # the average is exactly the target
    assert gb == [3, 3, 3, 3, 1, 1, 1, 1]
    assert bool((sal[:4].min() > sal[4:].max()))             # ... and the 3-bit groups are the salient ones
    # bytes: 4 groups x 64 x 64 weights at 3 bits + 4 at 1 bit, plus 8 width bytes
    assert out.tensors["codes3"].numel() == 4 * 64 * 64 * 3 // 8
    assert out.tensors["codes1"].numel() == 4 * 64 * 64 // 8 and out.tensors["group_bits"].numel() == 8
    codes = comp.codes(out.tensors, (64, 512))
    assert torch.equal(comp.encode_weight(out.tensors, comp.decode(out.tensors, (64, 512))), codes)
    assert int(codes[:4].min()) == -4 and int(codes[4:].max()) <= 0
    uniform = compressor("glvq", bits=2, group_size=64, allocation="uniform").compress(w.clone(), h)
    mixed_err, uniform_err = relative_error(w, out.weight, h), relative_error(w, uniform.weight, h)
    assert mixed_err < 0.8 * uniform_err, (mixed_err, uniform_err)


def test_regulariser_gradient_pulls_towards_the_initial_generator():
    from rankwise.compress.glvq.lattice import generator_penalty
    g = torch.Generator().manual_seed(0)
    gen0 = torch.randn(3, 8, 8, generator=g)
    gen = (gen0 + 0.3 * torch.randn(3, 8, 8, generator=g)).requires_grad_(True)
    w0, lam = torch.tensor([2.0, 0.5, 1.0]), 0.1
    generator_penalty(gen, gen0, w0, lam).sum().backward()
    formula = 2 * lam * w0[:, None, None] * (gen - gen0) / gen0.pow(2).sum((1, 2), keepdim=True)
    assert torch.allclose(gen.grad, formula.detach(), rtol=1e-5, atol=1e-8)
    stepped = gen.detach() - 1.0 * gen.grad                  # a descent step moves G towards G⁽⁰⁾
    assert bool(((stepped - gen0).norm(dim=(1, 2)) < (gen.detach() - gen0).norm(dim=(1, 2))).all())


def test_mu_stays_in_10_to_255():
    from rankwise.compress.glvq.lattice import MU_RANGE
    assert MU_RANGE == (10.0, 255.0)
    w, h = problem(32, 128)                                  # Gaussian weights: μ used to fall to 0.01
    for bits in (2, 4):
        comp = compressor("glvq", bits=bits, group_size=32, rounds=3, steps=10, lr=0.5)
        mu = comp.compress(w.clone(), h).tensors["mu"]
        assert float(mu.min()) >= 10 and float(mu.max()) <= 255


def test_mixed_widths_survive_the_compression_file(tmp_path):
    from dataclasses import asdict

    from rankwise.compress.io import load_compressed, save_compressed
    w, h = _salient_problem()
    comp = compressor("glvq", bits=2, group_size=64, rounds=1, steps=2)
    out = comp.compress(w.clone(), h)
    assert len(set(out.info["group_bits"])) == 2
    path = save_compressed(tmp_path / "c.safetensors", "glvq", asdict(comp.config), {"layer": out})
    assert torch.equal(load_compressed(path)["layer"], out.weight)
