"""APOLLO / APOLLO-Mini: parity with the authors' ``apollo-torch``, the state formula, the limiter,
the seeded projection, and config refusals."""
import math

import pytest
import torch

from rankwise import registry
from rankwise.configs import from_dict, problems_of
from rankwise.errors import RankwiseError
from rankwise.optim.apollo import ApolloAdamW, optimizer as apollo_module
from rankwise.optim.common import state_bytes


@pytest.mark.parametrize("shape", [(12, 6), (6, 12)])
@pytest.mark.parametrize("scale_type,scale", [("channel", 1.0), ("tensor", 4.0)])
def test_matches_apollo_torch_with_the_same_projection(monkeypatch, shape, scale_type, scale):
    """Four steps inside one projection period (limiter on) equal the authors' package.

    The two draw their projections from different RNG streams (the package seeds each parameter
    by its position and chains seeds; ours hashes (seed, index, period)), so the package's own
    matrix is injected into ours: ``(m, r)`` as is for wide matrices, ``(r, n)`` transposed for
    tall ones. eps 1e-12 removes the one arithmetic difference (where eps sits)."""
    apollo_torch = pytest.importorskip("apollo_torch")
    from apollo_torch.random_projector import stable_randn
    m, n = shape
    rank = 2
    theirs_p = stable_randn((m, rank) if m < n else (rank, n), seed=1) / math.sqrt(rank)
    ours_p = theirs_p if m < n else theirs_p.T                          # (min(m, n), r)
    monkeypatch.setattr(apollo_module, "random_basis", lambda *a, **k: ours_p.clone())
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(*shape, generator=gen)
    grads = [torch.randn(*shape, generator=gen) * (1 + 3 * (k == 2)) for k in range(4)]  # step 3 trips the limiter
    outs = []
    for build in (
        lambda w: ApolloAdamW([{"params": [w], "rank": rank, "update_every": 10, "scale": scale,
                                "scale_type": scale_type}], lr=0.01, eps=1e-12),
        lambda w: apollo_torch.APOLLOAdamW([{"params": [w], "rank": rank, "proj": "random",
                                             "scale_type": scale_type, "scale": scale,
                                             "update_proj_gap": 10, "proj_type": "std"}], lr=0.01, eps=1e-12),
    ):
        w = torch.nn.Parameter(w0.clone())
        opt = build(w)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        outs.append(w.detach())
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(outs[0], w0, atol=1e-3)


@pytest.mark.parametrize("name,rank,per_matrix", [
    ("apollo", 3, lambda m, n, r: 2 * max(m, n) * r),     # channel-wise: 2 c r
    ("apollo-mini", 1, lambda m, n, r: 2 * max(m, n)),    # rank 1: 2 c, SGD-like
])
def test_state_is_the_projected_moments_only(name, rank, per_matrix):
    """State bytes = 4 x (2 max(m, n) r) per matrix; the projection is regenerated, not stored."""
    shapes = [(16, 40), (40, 16), (24, 24)]
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = ApolloAdamW([{"params": params, "rank": rank, "scale_type": "channel" if rank > 1 else "tensor"}])
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert state_bytes(opt) == 4 * sum(per_matrix(m, n, rank) for m, n in shapes)
    assert set(opt.state[params[0]]) == {"step", "exp_avg", "exp_avg_sq", "scaled_norm"}


def test_projection_is_redrawn_each_period_and_reproducible(monkeypatch):
    drawn = []
    real = apollo_module.random_basis
    monkeypatch.setattr(apollo_module, "random_basis", lambda *a: drawn.append(real(*a)) or drawn[-1])
    w = torch.nn.Parameter(torch.zeros(8, 20))
    opt = ApolloAdamW([{"params": [w], "rank": 2, "update_every": 3}])
    for _ in range(6):
        w.grad = torch.randn(8, 20)
        opt.step()
    assert all(torch.equal(drawn[0], d) for d in drawn[1:3])       # steps 1-3: one projection
    assert not torch.equal(drawn[0], drawn[3])                     # step 4: a new draw
    assert drawn[0].shape == (8, 2)
    assert abs(float(torch.cat(drawn).var()) - 1 / 2) < 0.25       # entries N(0, 1/r)


def test_norm_growth_limiter_bounds_each_step():
    """With a constant lr, no decay: ||dW_t|| <= 1.01 ||dW_{t-1}|| even when the gradient jumps 100x."""
    w = torch.nn.Parameter(torch.zeros(10, 30))
    opt = ApolloAdamW([{"params": [w], "rank": 4}], lr=0.1)
    gen = torch.Generator().manual_seed(1)
    norms = []
    for k in range(5):
        before = w.detach().clone()
        w.grad = torch.randn(10, 30, generator=gen) * (100 if k == 3 else 1)
        opt.step()
        norms.append(float((w.detach() - before).norm()))
    assert all(b <= 1.01 * a * (1 + 1e-5) for a, b in zip(norms, norms[1:])), norms


@pytest.mark.parametrize("name,over,message", [
    ("apollo-mini", {"rank": 4}, "apollo-mini is rank 1 with tensor-wise scaling: got rank 4"),
    ("apollo", {"scale_type": "row"}, r"scale_type: got 'row'; expected one of \['channel', 'tensor'\]"),
    ("apollo", {"norm_growth": 0.5}, "norm_growth: got 0.5"),
    ("apollo", {"state_bits": 4}, "the bitsandbytes backend stores optimizer state in 8 bits only"),
])
def test_bad_settings_are_one_message(name, over, message):
    cls = registry.get("optimizer", name).config_cls
    assert len(problems_of(cls(**over))) == 1
    with pytest.raises(RankwiseError, match=message):
        from_dict(cls, {"name": name, **over}, "optim")
