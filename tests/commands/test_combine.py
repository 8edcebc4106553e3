"""The merge rules of ``commands/merge/combine.py`` on hand-computed examples (PEFT parity on real adapters
is in ``tests/commands/test_merge.py``)."""
from __future__ import annotations

import torch

from rankwise.commands.merge.combine import Pair, drop_and_rescale, trim
from rankwise.commands.merge.rules import build_rule, rule_config


def rule(name: str, **settings):
    """The registered merge rule ``name`` made from its config."""
    return build_rule(rule_config(name, **settings))


def test_ties_trims_elects_and_averages_by_hand():
    t1 = torch.tensor([3.0, -1.0, 2.0, 0.5])
    t2 = torch.tensor([-2.0, -4.0, 1.0, 0.1])
    # trim at density 0.5: t1 -> [3, 0, 2, 0], t2 -> [-2, -4, 0, 0]; votes (sum) [1, -4, 2, 0]
    # -> signs [+, -, +, +]; weighted [3, 0, 2, 0] and 0.5 * [-2, -4, 0, 0]; agreeing entries only
    got = rule("ties", density=0.5).combine_tensors([t1, t2], [1.0, 0.5])
    torch.testing.assert_close(got, torch.tensor([3.0, -2.0, 2.0, 0.0]), atol=0, rtol=0)


def test_ties_sign_election_total_versus_frequency():
    ts = [torch.tensor([5.0]), torch.tensor([-1.0]), torch.tensor([-1.0])]
    # total: 5 - 1 - 1 > 0 -> +, only the 5 agrees; frequency: one + and two - -> -, mean of -1, -1
    assert rule("ties", density=1.0).combine_tensors(ts, [1.0, 1.0, 1.0]).item() == 5.0
    assert rule("ties", density=1.0, sign_method="frequency").combine_tensors(ts, [1.0, 1.0, 1.0]).item() == -1.0


def test_trim_keeps_the_largest_magnitudes():
    t = torch.tensor([[0.1, -5.0], [2.0, -0.3]])
    torch.testing.assert_close(trim(t, 0.5), torch.tensor([[0.0, -5.0], [2.0, 0.0]]), atol=0, rtol=0)
    assert trim(t, 1.0) is t  # density 1 prunes nothing


def test_dare_mask_is_the_global_generators_and_unbiased():
    t = torch.ones(200_000)
    gen = torch.Generator().manual_seed(7)
    got = drop_and_rescale(t, 0.3, gen)
    torch.manual_seed(7)  # the same stream as torch's global generator seeded alike (PEFT's)
    want = torch.bernoulli(torch.full_like(t, 0.3)) / 0.3
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert abs((got != 0).float().mean().item() - 0.3) < 0.005  # keep rate = density
    assert abs(got.mean().item() - 1.0) < 0.02  # rescaling keeps the expectation


def _pairs(seed: int, ranks=(2, 3), out=6, inp=5):
    g = torch.Generator().manual_seed(seed)
    return [Pair(torch.randn(r, inp, generator=g), torch.randn(out, r, generator=g), s)
            for r, s in zip(ranks, (0.5, 2.0))]


def test_cat_is_the_exact_weighted_sum_of_deltas():
    pairs = _pairs(0)
    a, b = rule("cat").combine(pairs, [0.7, -0.4], rank=6)  # one zero-padded row
    want = sum(w * p.scale * p.b @ p.a for p, w in zip(pairs, [0.7, -0.4]))
    torch.testing.assert_close(b @ a, want, atol=1e-6, rtol=0)
    assert a.shape == (6, 5) and b.shape == (6, 6) and not a[5].any()


def test_linear_keeps_the_cross_terms():
    pairs = _pairs(1, ranks=(3, 3))
    w = [0.7, -0.4]
    a, b = rule("linear").combine(pairs, w, rank=3)
    c = [wi * p.scale for wi, p in zip(w, pairs)]
    a_want = sum((1 if ci >= 0 else -1) * abs(ci) ** 0.5 * p.a for ci, p in zip(c, pairs))
    b_want = sum(abs(ci) ** 0.5 * p.b for ci, p in zip(c, pairs))
    torch.testing.assert_close(a, a_want, atol=1e-6, rtol=0)
    torch.testing.assert_close(b, b_want, atol=1e-6, rtol=0)


def test_svd_is_the_best_rank_k_approximation():
    pairs = _pairs(2)
    full = sum(w * p.scale * p.b @ p.a for p, w in zip(pairs, [1.0, 0.5]))  # rank 5
    s = torch.linalg.svdvals(full)
    a, b = rule("svd").combine(pairs, [1.0, 0.5], rank=3)
    err = torch.linalg.matrix_norm(full - b @ a) ** 2
    torch.testing.assert_close(err, (s[3:] ** 2).sum(), atol=1e-5, rtol=1e-5)  # Eckart-Young
    a, b = rule("svd").combine(pairs, [1.0, 0.5], rank=5)
    torch.testing.assert_close(b @ a, full, atol=1e-5, rtol=0)


def test_a_layer_missing_from_one_adapter_takes_the_others_only():
    p = _pairs(3, ranks=(2, 2))
    a, b = rule("cat").combine([None, p[1]], [0.3, 0.5], rank=4)
    torch.testing.assert_close(b @ a, 0.5 * p[1].scale * p[1].b @ p[1].a, atol=1e-6, rtol=0)
