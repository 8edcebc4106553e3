"""LoTA-QAF: the integer-grid base (RTN, packing), the forward of the paper's Sec. 3 against an
explicit computation, the bit-exact integer merge (codes = base codes + m, all on the grid), the
merged model's output with and without the offset factors, and the bad-input errors."""
import pytest
import torch
from torch import nn

import rankwise
from rankwise.adapters.lota import LotaConfig, LotaLayer, QuantLinear, pack, rtn_quantize, unpack
from rankwise.configs import from_dict
from rankwise.core import merge_adapters, unmerge_adapters
from rankwise.core.weights import dense_weight
from rankwise.errors import RankwiseError
from rankwise.testing import tiny_batch, tiny_gpt2_lm, tiny_llama_lm


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip_and_rtn_error(bits):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(6, 32, generator=g)
    codes, scale, zero = rtn_quantize(w, bits, 8)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2 ** bits - 1
    assert torch.equal(unpack(pack(codes, bits), bits), codes)
    assert pack(codes, bits).shape == (6, 32 * bits // 8)
    deq = (scale.unsqueeze(-1) * (codes.float().reshape(6, 4, 8) - zero.unsqueeze(-1))).reshape(6, 32)
    assert (deq - w).abs().max() <= 0.5 * scale.max() + 1e-6        # round to nearest
    assert torch.equal(zero, zero.round())                           # integer zero points (GPTQ)


def _layer(bits=4, r=4, seed=0, edge=True):
    """A LoTA layer on a 4x16 QuantLinear (groups of 8) with random ternary B (so Delta != 0)
    and, with ``edge``, codes pushed to the grid's ends where the masks must act."""
    torch.manual_seed(seed)
    base = QuantLinear.from_linear(nn.Linear(16, 4), bits, 8)
    if edge:
        codes = base.codes()
        codes[0, :8] = base.maxq
        codes[1, :8] = 0
        base.set_codes(codes)
    layer = LotaLayer(base)
    layer.add("default", r, threshold_ratio=0.5)                    # omega = 2
    a = torch.randint(-1, 2, (r, 16)).float()
    a[:, :8] = 1                                  # Delta[i, :8] = sum of row i of B
    b = torch.randint(-1, 2, (4, r)).float()
    b[0], b[1], b[2] = 1, -1, 1                   # Delta = +r, -r, +r on the first group
    with torch.no_grad():
        layer.lota_A["default"].copy_(a)
        layer.lota_B["default"].copy_(b)
    return layer


def _explicit_weight(layer):
    """Notes §5: m from the thresholded Delta and the grid masks, R = Delta - omega m,
    zp = group mean of R / omega, W' = s ((q - z) + m + zp)."""
    base, omega = layer.base_layer, layer.omegas["default"]
    q = base.codes().float()
    delta = layer.lota_B["default"].detach() @ layer.lota_A["default"].detach()
    m = torch.zeros_like(delta)
    m[(delta > omega) & (q < base.maxq)] = 1
    m[(delta < -omega) & (q > 0)] = -1
    zp = (delta - omega * m).reshape(4, 2, 8).mean(-1) / omega
    s, z = base.scales.repeat_interleave(8, 1), base.zeros.repeat_interleave(8, 1)
    return s * ((q - z) + m + zp.repeat_interleave(8, 1)), m, zp


def test_forward_is_the_papers_formula_with_grid_masks():
    layer = _layer()
    expect, m, _ = _explicit_weight(layer)
    delta = layer.lota_B["default"].detach() @ layer.lota_A["default"].detach()
    assert bool((delta[0, :8] > 2).any()) and not bool((m[0, :8] > 0).any())   # blocked at 15
    assert bool((delta[1, :8] < -2).any()) and not bool((m[1, :8] < 0).any())  # blocked at 0
    assert torch.equal(m[2, :8] == 1, layer.base_layer.codes()[2, :8] < 15)    # +1 where allowed
    assert bool((m != 0).any())
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), x @ expect.T + layer.base_layer.bias, atol=1e-5, rtol=0)


def test_straight_through_gradient():
    layer = _layer()
    x = torch.randn(5, 16)
    layer(x).square().sum().backward()
    a, b = layer.lota_A["default"], layer.lota_B["default"]
    base, omega = layer.base_layer, layer.omegas["default"]
    gw = 2 * (x @ layer.adapted_weight().detach().T + base.bias).T @ x       # dL/dW' (4, 16)
    s = base.scales.repeat_interleave(8, 1)
    g_delta = s * gw + (s * gw).reshape(4, 2, 8).sum(-1).repeat_interleave(8, 1) / (8 * omega)
    torch.testing.assert_close(b.grad, g_delta @ a.detach().T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.grad, b.detach().T @ g_delta, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_merge_is_bit_exact_integer_arithmetic(bits):
    layer = _layer(bits=bits)
    x = torch.randn(3, 16)
    adapted = layer(x).detach()
    before = layer.base_layer.codes().clone()
    _, m, _ = _explicit_weight(layer)
    layer.merge("default")
    after = layer.base_layer.codes()
    assert torch.equal(after.to(torch.int16), before.to(torch.int16) + m.to(torch.int16))   # q + m
    assert int(after.min()) >= 0 and int(after.max()) <= 2 ** bits - 1                   # on the grid
    torch.testing.assert_close(layer(x), adapted, atol=1e-5, rtol=0)    # offsets folded into z
    layer.unmerge()
    assert torch.equal(layer.base_layer.codes(), before)
    torch.testing.assert_close(layer(x), adapted, atol=1e-6, rtol=0)


def test_merge_without_offsets_differs_by_exactly_the_offset_term():
    layer = _layer()
    layer.fold_offsets = False
    x = torch.randn(3, 16)
    adapted = layer(x).detach()
    _, _, zp = _explicit_weight(layer)
    zeros = layer.base_layer.zeros.clone()
    layer.merge("default")
    assert torch.equal(layer.base_layer.zeros, zeros)                   # integer zero points kept
    offset = (layer.base_layer.scales * zp).repeat_interleave(8, 1)     # s * zp per row and group
    torch.testing.assert_close(layer(x), adapted - x @ offset.T, atol=1e-5, rtol=0)
    assert float(offset.abs().max()) > 0


def test_model_merge_is_lossless_and_codes_stay_on_the_grid():
    model = tiny_llama_lm()
    rankwise.apply(model, "lota-qaf", r=4, threshold_ratio=0.25)
    layers = [m for m in model.modules() if isinstance(m, LotaLayer)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers:
            layer.lota_B["default"].copy_(torch.randint(-1, 2, layer.lota_B["default"].shape, generator=g).float())
    batch = {k: v for k, v in tiny_batch("llama").items() if k != "labels"}
    with torch.no_grad():
        adapted = model(**batch).logits
    codes = [layer.base_layer.codes().clone() for layer in layers]
    merge_adapters(model)
    moved = sum(int((layer.base_layer.codes() != c).sum()) for layer, c in zip(layers, codes))
    assert moved > 0 and all(int(layer.base_layer.codes().max()) <= 15 for layer in layers)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, adapted, atol=1e-4, rtol=0)
    unmerge_adapters(model)
    assert all(torch.equal(layer.base_layer.codes(), c) for layer, c in zip(layers, codes))


def test_group_size_is_capped_at_the_input_size_and_dense_weight_reads_the_grid():
    model = tiny_llama_lm()                       # 16- and 32-wide inputs: group 128 -> 16 / 32
    rankwise.apply(model, "lota-qaf", r=2)
    q = model.model.layers[0].mlp.down_proj.base_layer
    assert isinstance(q, QuantLinear) and q.group_size == 32 and q.scales.shape == (16, 1)
    assert q.weight.dtype == torch.uint8 and q.weight.shape == (16, 16)          # 4 bits, packed
    torch.testing.assert_close(dense_weight(model.model.layers[0].mlp.down_proj), q.dequantize())


@pytest.mark.parametrize("over,message", [
    ({"bits": 3}, "bits: got 3; expected one of \\[2, 4, 8\\]"),
    ({"group_size": 0}, "group_size: got 0"),
    ({"threshold_ratio": 1.5}, "threshold_ratio: got 1.5"),
])
def test_bad_config(over, message):
    with pytest.raises(RankwiseError, match=message):
        from_dict(LotaConfig, {"name": "lota-qaf", **over}, "method")


def test_group_size_that_does_not_divide_is_one_error_naming_the_layers():
    with pytest.raises(RankwiseError, match=r"method.group_size: 12 .* does not divide the input size of "
                                            r"model.layers.0.self_attn.q_proj \(in=16\)"):
        rankwise.apply(tiny_llama_lm(), "lota-qaf", group_size=12)
    with pytest.raises(RankwiseError, match="GPT-2 Conv1D"):
        rankwise.apply(tiny_gpt2_lm(), "lota-qaf", r=2)


def test_the_example_configs_validate():
    from pathlib import Path

    from rankwise.recipes.config import load_run_config
    root = Path(__file__).resolve().parents[2] / "examples"
    lota = load_run_config(root / "lota-qaf.yaml")
    assert (lota.method.name, lota.method.r, lota.optim.name, lota.optim.total_steps) == ("lota-qaf", 16, "t-signsgd", 40)
    assert lota.train.grad_clip is None  # t-SignSGD's spike guard sees the raw gradient norm
    nano = load_run_config(root / "nanoadam.yaml")
    assert (nano.method.name, nano.optim.name, nano.optim.density) == ("full", "nanoadam", 0.1)
