"""Q3R: regularizer value and gradient against a direct computation; the step; truncation."""
import copy

import pytest
import torch

from rankwise.optim.q3r import (Q3RAdamW, q3r_operator, q3r_value, reweight, reweight_tracked,
                                 truncate_to_factorized)
from rankwise.testing import tiny_batch, tiny_llama_lm


def _direct_value(x, w0, eps):
    """sum_ij H_ij (u_i^T X v_j)^2 with H_ij = eps^2 / (max(s_i, eps) max(s_j, eps)) in the full
    singular bases of w0 (directions beyond the spectrum get weight 1)."""
    u, s, vh = torch.linalg.svd(w0, full_matrices=True)
    m, n = w0.shape
    def weights(k):
        out = torch.ones(k, dtype=w0.dtype)
        out[: len(s)] = eps / torch.clamp(s, min=eps)
        return out
    c = u.T @ x @ vh.T
    return (weights(m)[:, None] * weights(n)[None, :] * c ** 2).sum()


def test_value_and_gradient_match_direct_computation():
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    r = 2
    u, v, sp, eps = reweight(w0, r, float("inf"))
    s = torch.linalg.svdvals(w0)
    assert eps == pytest.approx(float(s[r]), rel=1e-12)  # eps <- min(inf, sigma_{r+1})
    assert torch.allclose(sp, eps / s[:r] - 1)
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    direct = _direct_value(x, w0, eps)
    assert torch.allclose(q3r_value(x.detach(), u, v, sp), direct.detach(), rtol=1e-10)
    direct.backward()
    assert torch.allclose(2 * q3r_operator(x.detach(), u, v, sp), x.grad, rtol=1e-10)
    # The operator is self-adjoint, so <Y, R(X)> = <R(Y), X>.
    y = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    assert torch.allclose((y * q3r_operator(x.detach(), u, v, sp)).sum(), (q3r_operator(y, u, v, sp) * x.detach()).sum())


def test_eps_is_monotone():
    w = torch.randn(8, 8, dtype=torch.float64)
    _, _, _, eps = reweight(w, 3, 1e-3)
    assert eps == 1e-3


def test_step_is_adamw_plus_decoupled_regularizer():
    gen = torch.Generator().manual_seed(1)
    w0, g = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
    w = torch.nn.Parameter(w0.clone())
    ref = torch.nn.Parameter(w0.clone())
    opt = Q3RAdamW([{"params": [w], "rank": 2, "lam": 0.5}], lr=0.01)
    ref_opt = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.0)
    w.grad, ref.grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
    u, v, sp, _ = reweight(w0, 2, float("inf"))
    expect = ref.detach() - 0.01 * 0.5 * 2 * q3r_operator(w0, u, v, sp)
    assert torch.allclose(w, expect, atol=1e-6)


def test_regularizer_drives_tail_spectrum_down():
    gen = torch.Generator().manual_seed(2)
    target = torch.randn(16, 16, generator=gen)
    tails = []
    for lam in (0.0, 1.0):
        w = torch.nn.Parameter(torch.zeros(16, 16))
        opt = Q3RAdamW([{"params": [w], "rank": 4, "lam": lam, "update_every": 5}], lr=0.02)
        for _ in range(150):
            opt.zero_grad()
            ((w - target) ** 2).mean().backward()
            opt.step()
        s = torch.linalg.svdvals(w.detach())
        tails.append(float(s[4:].norm() / s.norm()))
    assert tails[1] < 0.75 * tails[0]


def test_truncate_to_factorized_equals_rank_r_weights():
    model = tiny_llama_lm()
    ref = copy.deepcopy(model)
    r = 3
    with torch.no_grad():
        for name, mod in ref.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in name:
                u, s, vh = torch.linalg.svd(mod.weight, full_matrices=False)
                mod.weight.copy_(u[:, :r] @ torch.diag(s[:r]) @ vh[:r])
    report = truncate_to_factorized(model, rank=r)
    assert report["layers"] == 14
    assert report["params_after"] < report["params_before"]
    batch = tiny_batch("llama")
    assert torch.allclose(model(**batch).logits, ref(**batch).logits, atol=1e-5)


@pytest.mark.parametrize("iters,share,atol", [(1, 0.2, 1e-2), (2, 0.05, 1e-3)])
def test_tracked_reweighting_matches_the_exact_one_on_a_slowly_moving_weight(iters, share, atol):
    """Between reweightings the top-8 subspace moves by ~5e-2 (projector distance); warm-started
    power iterations land within a share of that of the exact one (measured: one iteration
    ~5e-3, two ~1e-3)."""
    gen = torch.Generator().manual_seed(5)
    u0 = torch.linalg.qr(torch.randn(48, 48, generator=gen))[0]
    v0 = torch.linalg.qr(torch.randn(64, 48, generator=gen))[0]
    w = u0 @ torch.diag(torch.logspace(0, -2, 48)) @ v0.T               # (48, 64), decaying spectrum
    u, v, sp, eps = reweight(w, 8, float("inf"))
    for _ in range(4):
        w = w + 1e-3 * torch.randn(48, 64, generator=gen)
        exact = reweight(w, 8, eps)
        moved = (exact[0] @ exact[0].T - u @ u.T).norm()
        u, v, sp, eps = reweight_tracked(w, 8, eps, u, iters=iters, generator=gen)
        assert (u @ u.T - exact[0] @ exact[0].T).norm() < share * moved
        assert eps == pytest.approx(exact[3], rel=1e-2)                   # sigma_{r+1} schedule
        torch.testing.assert_close(sp, exact[2], atol=atol, rtol=0)
