"""S'MoRE: the d_l recursion, zero W_final (base output at init), the tree forward against a
per-token recursive reference with key-conditioned child routing (1 and 2 levels), and the
balance loss summed over levels."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise.adapters.common.routing import switch_balance_loss
from rankwise.adapters.smore import SmoreConfig, SmoreLayer, apply_smore
from rankwise.configs import from_dict
from rankwise.errors import RankwiseError
from rankwise.testing import tiny_batch, tiny_llama_lm


def make_layer(experts, ranks, fanout, gate_dims, alpha=None, act="tanh", seed=0) -> SmoreLayer:
    torch.manual_seed(seed)
    layer = SmoreLayer(nn.Linear(6, 5))
    layer.add("default", {"ranks": ranks, "experts": experts, "fanout": fanout, "gate_dims": gate_dims,
                          "down_dim": 3, "alpha": alpha, "expert_act": act, "gate_act": "relu",
                          "balance_weight": 0.01})
    return layer


def reference(tree, x: torch.Tensor) -> torch.Tensor:
    """S'MoRE for ONE token, written as the recursion over the routed tree (notes §4.2)."""
    levels, act = tree.levels, tree.act

    def expert(l, j):
        lev = levels[l]
        return tree.scales[l] * (lev.B[j] @ (lev.A[j] @ x + lev.a[j]) + lev.b[j])

    def subtree(l, gate_in):
        lev = levels[l]
        probs = torch.softmax(lev.gate(gate_in) @ lev.keys.T, -1)
        top = probs.topk(tree.fanout[l])
        scores = top.values / top.values.sum() if tree.fanout[l] > 1 else top.values
        total = 0
        for g, j in zip(scores, top.indices):
            z = expert(l, j)
            if l > 0:  # the child subtree is routed with this expert's key appended
                z = z + lev.W @ subtree(l - 1, torch.cat([gate_in, lev.keys[j]])) + lev.w
            total = total + g * act(z)
        return total

    return tree.W_final @ subtree(len(levels) - 1, tree.down(x)) + tree.b_final


def test_width_recursion_and_shapes():
    layer = make_layer(experts=[4, 3], ranks=[2, 3], fanout=[2, 2], gate_dims=[5, 4])
    tree = layer.trees["default"]
    assert tree.d == [0, 8, 17]                                      # d_{l+1} = d_l + s_l r_l
    lev0, lev1 = tree.levels
    assert lev0.A.shape == (4, 2, 6) and lev0.B.shape == (4, 8, 2) and lev0.W is None
    assert lev1.A.shape == (3, 3, 6) and lev1.B.shape == (3, 17, 3) and lev1.W.shape == (17, 8)
    assert tree.W_final.shape == (5, 17) and float(tree.W_final.detach().abs().sum()) == 0.0
    assert lev0.gate[0].in_features == 3 + 4 and lev1.gate[0].in_features == 3  # ancestors' keys
    assert layer.describe("default")["d"] == [0, 8, 17]


@pytest.mark.parametrize("shape", [([4], [3], [2], [4], None), ([4, 3], [2, 3], [2, 2], [5, 4], [4.0, 6.0]),
                                   ([3, 2, 2], [1, 2, 1], [2, 1, 2], [3, 3, 3], None)])
def test_forward_matches_the_recursive_tree(shape):
    experts, ranks, fanout, gate_dims, alpha = shape
    layer = make_layer(experts, ranks, fanout, gate_dims, alpha)
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(layer(x), layer.base_layer(x), atol=0, rtol=0)  # W_final = 0
    tree = layer.trees["default"]
    with torch.no_grad():
        for p in tree.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        got = layer(x)
        want = torch.stack([reference(tree, t) for t in x.reshape(-1, 6)]).reshape(2, 3, 5)
    torch.testing.assert_close(got, layer.base_layer(x) + want, atol=1e-5, rtol=0)


def test_balance_loss_sums_the_levels():
    layer = make_layer(experts=[4, 3], ranks=[2, 2], fanout=[2, 2], gate_dims=[4, 4])
    tree = layer.trees["default"]
    x = torch.randn(5, 6)
    layer.train()
    layer(x)
    got = float(layer.aux_losses()["balance_loss"].detach())
    with torch.no_grad():  # the same routing, recomputed level by level
        x_bar = tree.down(x)
        p1 = torch.softmax(tree.levels[1].gate(x_bar[:, None]) @ tree.levels[1].keys.T, -1)   # (5, 1, 3)
        i1 = p1.topk(2).indices
        gate0 = torch.cat([x_bar[:, None, None].expand(-1, 1, 2, -1), tree.levels[1].keys[i1]], -1)
        p0 = torch.softmax(tree.levels[0].gate(gate0.flatten(1, 2)) @ tree.levels[0].keys.T, -1)  # (5, 2, 4)
        want = sum(switch_balance_loss(p, torch.zeros_like(p).scatter(-1, p.topk(2).indices, 1.0), 0.01)
                   for p in (p1, p0))
    assert abs(got - float(want)) < 1e-7
    stats = layer.statistics()
    assert stats["default/level1"]["train"]["decisions"] == 5 and stats["default/level0"]["train"]["decisions"] == 10


def test_multi_level_on_a_model_starts_at_the_base():
    base, model = tiny_llama_lm(), tiny_llama_lm()
    apply_smore(model, SmoreConfig(experts=[4, 4], ranks=[2, 2], fanout=[2, 2], gate_dims=[4, 4],
                                   down_dim=4, targets=["up_proj", "down_proj"]))
    batch = {k: v for k, v in tiny_batch("llama").items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, base(**batch).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad,match", [({"fanout": [5]}, "picks 5 of 4 experts"),
                                       ({"experts": [0]}, "every value must be >= 1"),
                                       ({"ranks": [2, 2]}, "expected 1 value")])
def test_bad_config(bad, match):
    with pytest.raises(RankwiseError, match=match):
        from_dict(SmoreConfig, {"name": "smore", **bad}, "method")
