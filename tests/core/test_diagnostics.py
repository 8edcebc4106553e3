"""Known answers for ``core/diagnostics.py``: effective ranks of built spectra, Model Shapley's
closed form against enumerated Shapley values, the Fisher block product, and the low-rank
inverse bound on random SPD matrices of known spectrum."""
from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from rankwise.core.diagnostics import (effective_ranks, fisher_rows_times_theta, inverse_bounds,
                                       lowrank_inverse, neuron_scores, shapley_quadratic, shapley_scores)


def _orth(n: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=gen))
    return q


def _with_spectrum(s: list[float], rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u, v = _orth(rows, gen)[:, :len(s)], _orth(cols, gen)[:, :len(s)]
    return (u * torch.tensor(s, dtype=torch.float64)) @ v.T


def test_effective_ranks_of_known_spectra():
    flat = effective_ranks(torch.linalg.svdvals(_with_spectrum([1.0] * 4, 12, 9)))
    assert flat["entropy"] == pytest.approx(4.0, rel=1e-9)
    assert (flat["energy90"], flat["energy99"], flat["dim"]) == (4, 4, 9)
    # σ = (3, 1): p = (3/4, 1/4); energy 9/10 reaches 90 % at k = 1, 99 % needs k = 2.
    two = effective_ranks(torch.linalg.svdvals(_with_spectrum([3.0, 1.0], 6, 5, seed=1)))
    assert two["entropy"] == pytest.approx(math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))), rel=1e-9)
    assert (two["energy90"], two["energy99"]) == (1, 2)
    assert effective_ranks(torch.zeros(3))["entropy"] == 0.0


def _enumerated_shapley(v, n: int) -> torch.Tensor:
    """Shapley values of game ``v(frozenset)`` by enumeration of every coalition."""
    phi = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        others = [j for j in range(n) if j != i]
        for k in range(n):
            w = math.factorial(k) * math.factorial(n - k - 1) / math.factorial(n)
            for s in itertools.combinations(others, k):
                phi[i] += w * (v(frozenset(s) | {i}) - v(frozenset(s)))
    return phi


def test_closed_form_is_exact_shapley_on_a_quadratic_loss():
    """Game: v(S) = L(0) - L(θ on S, 0 elsewhere), the loss reduction S brings. For a quadratic
    L the second-order expansion at θ is exact, so φ = -g⊙θ + ½ θ⊙(Hθ) must equal the
    enumerated values (8 players, all 256 coalitions); the opposite sign of ½ must not."""
    gen = torch.Generator().manual_seed(3)
    n = 8
    m = torch.randn(n, n, dtype=torch.float64, generator=gen)
    h = m @ m.T + 0.1 * torch.eye(n, dtype=torch.float64)
    b = torch.randn(n, dtype=torch.float64, generator=gen)
    theta = torch.randn(n, dtype=torch.float64, generator=gen)

    def loss(x):
        return 0.5 * x @ h @ x - b @ x + 1.7

    hl, bl, tl, l0 = h.tolist(), b.tolist(), theta.tolist(), float(loss(torch.zeros(n, dtype=torch.float64)))

    @functools.lru_cache(maxsize=None)
    def v(s):  # L(0) - L(θ_S) in plain floats: 256 coalitions, each once
        x = [tl[i] if i in s else 0.0 for i in range(n)]
        quad = sum(x[i] * hl[i][j] * x[j] for i in range(n) for j in range(n))
        return l0 - (0.5 * quad - sum(bl[i] * x[i] for i in range(n)) + 1.7)

    exact = _enumerated_shapley(v, n)
    g = h @ theta - b
    phi = shapley_quadratic(g, theta, h @ theta)
    assert torch.allclose(phi, exact, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(-g * theta - 0.5 * theta * (h @ theta), exact)
    assert float(phi.sum()) == pytest.approx(v(frozenset(range(n))), rel=1e-10)  # efficiency

    # Neurons as players (rows of a 2x4 weight): the group's value is its members' sum.
    def v_rows(s):
        return v(frozenset(i for r in s for i in range(4 * r, 4 * r + 4)))
    assert torch.allclose(_enumerated_shapley(v_rows, 2), phi.reshape(2, 4).sum(1), rtol=1e-10, atol=1e-12)


def test_fisher_block_product_against_the_explicit_blocks():
    gen = torch.Generator().manual_seed(0)
    gb = torch.randn(5, 3, 4, dtype=torch.float64, generator=gen)  # (B, out, in)
    theta = torch.randn(3, 4, dtype=torch.float64, generator=gen)
    want = torch.stack([(sum(torch.outer(gb[b, r], gb[b, r]) for b in range(5)) / 5) @ theta[r]
                        for r in range(3)])
    torch.testing.assert_close(fisher_rows_times_theta(gb, theta), want)


def test_shapley_scores_on_a_linear_model_match_the_hand_formula():
    """y = W x, per-example loss ½‖Wx - y‖²: per-example gradient (Wx - y) xᵀ. One batch, so the
    bias-corrected EWMA is that batch's φ."""
    gen = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(2, 3, generator=gen))
    x, y = torch.randn(4, 3, generator=gen), torch.randn(4, 2, generator=gen)

    def loss(batch):
        return 0.5 * ((batch["x"] @ w.T - batch["y"]) ** 2).sum(-1).mean()

    phi = shapley_scores({"w": w}, [{"x": x, "y": y}], loss)["w"]
    gb = torch.stack([torch.outer(w.detach() @ x[i] - y[i], x[i]) for i in range(4)])
    want = -gb.mean(0) * w.detach() + 0.5 * w.detach() * fisher_rows_times_theta(gb, w.detach())
    torch.testing.assert_close(phi, want, rtol=1e-5, atol=1e-6)
    # The Conv1D layout gives the transposed answer.
    wt = torch.nn.Parameter(w.detach().T.clone())
    phi_t = shapley_scores({"w": wt}, [{"x": x, "y": y}],
                           lambda b: 0.5 * ((b["x"] @ wt - b["y"]) ** 2).sum(-1).mean(), transposed=["w"])["w"]
    torch.testing.assert_close(phi_t.T, want, rtol=1e-5, atol=1e-6)
    assert neuron_scores("grad_weight", {"w": w}, [{"x": x, "y": y}], loss)["w"].shape == (2,)


def _spd(lam: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q = _orth(len(lam), gen)
    return (q * lam) @ q.T, q


def test_inverse_bound_holds_on_100_random_spd_matrices():
    """Random spectra (uniform and geometric), random p, E random or aligned with the
    low-curvature directions, ‖E‖ anywhere inside the paper's condition."""
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for case in range(100):
        n = int(torch.randint(4, 24, (1,), generator=gen))
        p = int(torch.randint(1, n, (1,), generator=gen))
        if case % 2:
            lam = torch.logspace(0, -3 * float(torch.rand(1, generator=gen)) - 0.1, n, dtype=torch.float64)
        else:
            lam = (torch.rand(n, dtype=torch.float64, generator=gen) * 10 + 0.01).sort(descending=True).values
        a, q = _spd(lam, gen)
        if case % 3 == 0:  # aligned with the eigenvectors around the cut (the worst directions)
            v = q[:, n - p - 1:n - p + 1]
            e = v @ torch.randn(2, 2, dtype=torch.float64, generator=gen) @ v.T
        else:
            e = torch.randn(n, n, dtype=torch.float64, generator=gen)
        e = (e + e.T) / 2
        limit = min(float(lam[-1]), float(lam[n - p - 1] - lam[n - p])) / 4
        e = e / torch.linalg.matrix_norm(e, 2) * limit * float(torch.rand(1, generator=gen))
        r = inverse_bounds(a, e, p)
        assert r["applies"] and r["lambda_n"] == pytest.approx(float(lam[-1]))
        assert r["measured"] <= r["bound"], (case, r)
        worst = max(worst, r["measured"] / r["bound"])
    assert worst > 0.01  # the cases come near the bound, so the check has teeth


def test_inverse_bound_beats_the_naive_one_for_small_noise_and_knows_when_it_does_not_apply():
    lam = torch.tensor([10.0, 8.0, 5.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    a, _ = _spd(lam, torch.Generator().manual_seed(2))
    e = torch.eye(6, dtype=torch.float64) * 1e-3
    r = inverse_bounds(a, e, 2)  # p = 2: λ_{n-p} = 1, δ = 0.5
    want = 4e-3 / 0.25 ** 2 + 5e-3 / (1.0 * 0.5)
    assert r["bound"] == pytest.approx(want, rel=1e-9)
    naive = 1e-3 / (0.25 * (0.25 - 1e-3)) + 1 / (1 - 1e-3) + 1
    assert r["naive"] == pytest.approx(naive, rel=1e-9) and r["naive"] > 20 * r["bound"]
    # A scalar shift keeps the eigenvectors: the exact error is |1/(λ+ε) - 1/λ| at the smallest λ.
    assert r["measured"] == pytest.approx(1 / 0.25 - 1 / 0.251, rel=1e-6)
    big = inverse_bounds(a, torch.eye(6, dtype=torch.float64) * 0.1, 2)
    assert not big["applies"] and big["bound"] is None
    torch.testing.assert_close(lowrank_inverse(a, 5) @ a @ lowrank_inverse(a, 5), lowrank_inverse(a, 5))
    with pytest.raises(ValueError, match="1 <= p < n"):
        inverse_bounds(a, e, 6)
