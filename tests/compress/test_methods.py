"""Every registered compressor on one layer problem: exact decode, exact patterns, and the
numbers that define each method."""
import dataclasses

import pytest
import torch

from rankwise import registry
from rankwise.compress.base import relative_error
from rankwise.compress.formats import decode_sparse
from rankwise.compress.pattern import check_pattern, keep_mask

from compress_helpers import compressor, problem

ALL = registry.names("compressor")
PRUNERS = [n for n in ALL if "sparsity" in {f.name for f in dataclasses.fields(registry.get("compressor", n).config_cls)}]
FAST = {"3basil": {"tm_epochs": 0, "iterations": 40}, "glvq": {"rounds": 2, "steps": 3, "group_size": 32}, "svd": {"rank": 8}}


def test_registry_lists_every_family():
    assert set(ALL) >= {"3basil", "glvq", "magnitude", "wanda", "sparsegpt", "svd", "rtn", "gptq", "none"}
    assert set(PRUNERS) == {"3basil", "magnitude", "wanda", "sparsegpt"}


@pytest.mark.parametrize("name", ALL)
def test_decode_of_the_stored_form_is_the_weight(name):
    w, h = problem()
    comp = compressor(name, **FAST.get(name, {}))
    out = comp.compress(w.clone(), h)
    assert torch.equal(comp.decode(out.tensors, tuple(w.shape)), out.weight)
    assert out.nbytes == sum(t.numel() * t.element_size() for t in out.tensors.values())
    assert 0 <= relative_error(w, out.weight, h) < 1.0


def _sparse_part(name, comp, out, shape, nm):
    return decode_sparse(out.tensors, shape, nm)


@pytest.mark.parametrize("name", PRUNERS)
@pytest.mark.parametrize("pattern", ["2:4", "1:4", "2:8"])
def test_nm_pattern_is_exact(name, pattern):
    w, h = problem()
    comp = compressor(name, pattern=pattern, **FAST.get(name, {}))
    out = comp.compress(w.clone(), h)
    n, m = map(int, pattern.split(":"))
    s = _sparse_part(name, comp, out, tuple(w.shape), (n, m))
    assert check_pattern(s, (n, m))                    # every group of M has <= N nonzeros
    assert out.info["sparsity"] == pytest.approx(1 - n / m)


@pytest.mark.parametrize("name", PRUNERS)
@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.7])
def test_unstructured_sparsity_is_exact(name, sparsity):
    w, h = problem()
    comp = compressor(name, sparsity=sparsity, pattern=None, **FAST.get(name, {}))
    s = _sparse_part(name, comp, comp.compress(w.clone(), h), tuple(w.shape), None)
    nonzero = int((s != 0).sum())
    if name == "wanda":                                # Wanda compares within each output row
        assert ((s != 0).sum(1) <= round((1 - sparsity) * w.shape[1])).all()
    else:
        assert nonzero <= round((1 - sparsity) * w.numel())
        assert nonzero >= round((1 - sparsity) * w.numel()) - 2   # a kept weight may be exactly 0


def test_wanda_keeps_the_highest_weight_times_input_norm_per_row():
    w, h = problem(8, 16)
    s = _sparse_part("wanda", None, compressor("wanda", sparsity=0.5).compress(w.clone(), h), (8, 16), None)
    score = w.abs() * h.diagonal().sqrt()
    expect = torch.zeros_like(w, dtype=torch.bool).scatter_(1, score.topk(8, dim=1).indices, True)
    assert torch.equal(s != 0, expect) and torch.equal(s[expect], w[expect])


def test_sparsegpt_at_zero_sparsity_returns_the_weight():
    w, h = problem()
    out = compressor("sparsegpt", sparsity=0.0).compress(w.clone(), h)
    assert torch.allclose(out.weight, w, atol=1e-6)


@pytest.mark.parametrize("pattern", [None, "2:4"])
def test_sparsegpt_beats_magnitude_and_wanda_on_correlated_inputs(pattern):
    w, h = problem()
    err = {n: relative_error(w, compressor(n, pattern=pattern).compress(w.clone(), h).weight, h)
           for n in ("magnitude", "wanda", "sparsegpt")}
    assert err["sparsegpt"] < err["wanda"] < err["magnitude"], err


@pytest.mark.parametrize("bits", [4, 3])
def test_gptq_error_is_at_most_rtn_error_on_correlated_inputs(bits):
    w, h = problem(64, 256)
    rtn = relative_error(w, compressor("rtn", bits=bits).compress(w.clone(), h).weight, h)
    gptq = relative_error(w, compressor("gptq", bits=bits).compress(w.clone(), h).weight, h)
    assert gptq <= 0.8 * rtn, (gptq, rtn)


@pytest.mark.parametrize("name", ["rtn", "gptq"])
def test_scalar_codes_cost_bits_plus_group_metadata(name):
    w, h = problem(16, 256)
    out = compressor(name, bits=3, group_size=128).compress(w.clone(), h)
    assert out.tensors["codes"].numel() == 16 * 256 * 3 // 8
    assert out.tensors["scales"].dtype == torch.float16 and out.tensors["scales"].shape == (16, 2)
    assert out.info["bits_per_weight"] == pytest.approx(3 + (16 + 3) / 128)


def test_svd_whitened_beats_plain_at_the_same_rank_and_full_rank_is_exact():
    w, h = problem()
    plain = relative_error(w, compressor("svd", rank=8).compress(w.clone(), h).weight, h)
    white = relative_error(w, compressor("svd", rank=8, whiten=True).compress(w.clone(), h).weight, h)
    assert white < plain
    assert torch.allclose(compressor("svd", rank=32).compress(w.clone(), h).weight, w, atol=1e-5)


def test_svd_energy_picks_the_smallest_rank_holding_that_energy():
    w, h = problem()
    s = torch.linalg.svdvals(w.double())
    energy = (s ** 2).cumsum(0) / (s ** 2).sum()
    out = compressor("svd", energy=0.8).compress(w.clone(), h)
    assert out.info["rank"] == int((energy < 0.8).sum()) + 1


def test_layer_problems_name_the_fix():
    comp = compressor("3basil", rank=64)
    assert "lower compress.rank" in comp.config.layer_problems("q", (32, 48))[0]
    assert "multiple of M=4" in compressor("wanda", pattern="2:4").config.layer_problems("q", (8, 30))[0]
    assert "group_size" in compressor("glvq").config.layer_problems("q", (8, 96))[0]


def test_keep_mask_ties_do_not_break_exactness():
    s = torch.ones(4, 8)
    assert int(keep_mask(s, 0.5, None).sum()) == 16 and int(keep_mask(s, 0.5, (2, 4)).sum()) == 16
