"""SUMO: one step and a subspace change against the written formula; state size nr + mr."""
import math

import torch

from rankwise.optim.common import state_bytes
from rankwise.optim.sumo import SumoOptimizer, orthogonalize


def _polar(m):
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    return u @ vh


def test_orthogonalize_is_polar_factor():
    m = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))
    o = orthogonalize(m)
    assert torch.allclose(o.T @ o, torch.eye(3), atol=1e-5)
    assert torch.allclose(o, _polar(m), atol=1e-6)      # from the Gram matrix: the SVD's U V^T


def test_two_steps_with_transport_match_formula():
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(10, 6, generator=gen)           # tall: right projection, basis 6 x r
    g1, g2 = torch.randn(10, 6, generator=gen), torch.randn(10, 6, generator=gen)
    lr, mu, scale, r = 0.1, 0.9, 0.2, 2
    w = torch.nn.Parameter(w0.clone())
    opt = SumoOptimizer([{"params": [w], "rank": r, "update_every": 1, "momentum": mu, "scale": scale}], lr=lr)
    factor = lr * scale * math.sqrt(60 / r)

    def top_right(g):
        v = torch.linalg.svd(g)[2][:r].T          # (6, r)
        return v
    q1 = top_right(g1)
    m1 = g1 @ q1
    expect = w0 - factor * _polar(m1) @ q1.T
    w.grad = g1
    opt.step()
    q1s = opt.state[w]["proj_basis"]
    assert torch.allclose(q1s @ q1s.T, q1 @ q1.T, atol=1e-5)       # same subspace
    assert torch.allclose(w, expect, atol=1e-5)
    # Step 2: new subspace; the moment moves by (Q2^T Q1) before the new gradient is added.
    q2 = top_right(g2)
    m2 = mu * (m1 @ (q1.T @ q2)) + g2 @ q2
    expect = expect - factor * _polar(m2) @ q2.T
    w.grad = g2
    opt.step()
    assert torch.allclose(w, expect, atol=1e-5)


def test_state_bytes_equal_nr_plus_mr():
    for shape in [(12, 5), (5, 12)]:
        w = torch.nn.Parameter(torch.randn(*shape))
        opt = SumoOptimizer([{"params": [w], "rank": 3}])
        w.grad = torch.randn(*shape)
        opt.step()
        n, m = max(shape), min(shape)
        assert state_bytes(opt) == 4 * (n * 3 + m * 3)


def test_polar_batch_equals_the_svd_polar_factor():
    gen = torch.Generator().manual_seed(4)
    for shape in [(5, 3, 40), (4, 40, 3)]:                 # wide and tall batches
        ms = torch.randn(*shape, generator=gen)
        from rankwise.optim.sumo import polar_batch
        out = polar_batch(ms)
        for m, o in zip(ms, out):
            assert torch.allclose(o, _polar(m), atol=2e-6)
    # A rank-deficient moment: the zero direction is dropped (the SVD would keep an arbitrary one).
    m = torch.randn(3, 1, generator=gen) @ torch.randn(1, 8, generator=gen)   # rank 1
    o = orthogonalize(m)
    u, _, vh = torch.linalg.svd(m)
    assert torch.allclose(o, u[:, :1] @ vh[:1], atol=1e-6)
