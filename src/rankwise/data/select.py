"""Training-data selection: the tensor maths of the ``data.select`` rules.

Every rule here works on plain tensors (gradient features, embeddings, losses) so it can be
checked against a direct computation. Each rule is a registered entry of kind ``select-rule``
(its config and scoring function: :mod:`rankwise.recipes.select_rules`, which computes the
features from the run's model and data); :mod:`rankwise.recipes.select` applies the selection.
Rules:

- ``random``: a seeded permutation (the anchor every paper compares against).
- ``less``: LESS (Xia et al. 2024, "LESS: Selecting Influential Data for Targeted Instruction
  Tuning", Eq. 2 with SGD features): ``s_i = cos(P g_i, mean_j P g_j / |P g_j|)``, ``g_i`` the
  gradient of example ``i``'s loss w.r.t. the trainable (LoRA) weights, ``P`` a seeded Gaussian
  projection, ``j`` over the target examples.
- ``influence``: Influence Distillation (Nikdan et al. 2025, arXiv 2505.19051), the released
  first-order rule: landmark influences ``p_L = G_L G_Tᵀ`` (normalised projected gradients),
  propagated to every sample by kernel-ridge regression on JVP embeddings
  (``p = K(e, e_L) (K_LL + 0.01 mean(diag K_LL) I)⁻¹ p_L``, RBF kernel, σ = median landmark
  distance), then a round-robin pick over target examples in an order shuffled every round; the
  weighted variant solves the paper's second-order objective (:func:`influence_weights`).
- ``qcs-proxy`` (``qcs``, its old name, is read for one release with a notice): a proxy of QCS
  (Quadratic Coreset Selection, NeurIPS 2025), not the paper's method: the bi-level inner training is replaced by a
  one-step identity-Hessian quadratic on gradient features (:func:`qcs_objective`), the token
  masks are loss-ranked, not learned. Inclusion probabilities ``w`` of Bernoulli sequence masks,
  trained by REINFORCE on that quadratic, then projected onto ``{0 ≤ w ≤ 1, Σw = k}``
  (:func:`project_budget`).
- ``embedding``: nearest to the target by a sentence encoder: ``s_i = max_j cos(e_i, e_j)``.
"""
from __future__ import annotations

import math
from typing import Union

import torch


def budget_count(budget: Union[int, float], n: int) -> int:
    """Records kept: ``budget`` as a count, or ``round(budget * n)`` (at least 1) as a fraction.

    Raises:
        ValueError: A budget <= 0 or larger than the ``n`` records.
    """
    k = budget if isinstance(budget, int) else max(1, round(budget * n))
    if isinstance(budget, bool) or budget <= 0 or k > n or (isinstance(budget, float) and budget > 1):
        raise ValueError(f"data.select.budget: got {budget!r} for {n} training records; expected a "
                         f"fraction in (0, 1] or a count 1..{n}")
    return int(k)


def random_scores(n: int, seed: int) -> torch.Tensor:
    """Uniform scores from a generator seeded by ``seed`` (top-k of them = a seeded random pick)."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def top_k(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the ``k`` largest scores (ties broken by index), in increasing index order."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return sorted(order[:k])


def projection_block(rows: int, dim: int, seed: int, block: int) -> torch.Tensor:
    """Rows ``(rows, dim)`` of the Gaussian projection ``P / sqrt(dim)`` for parameter block
    ``block``: regenerated from ``(seed, block)`` each time, so ``P`` is never stored whole."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + block)
    return torch.randn(rows, dim, generator=g, dtype=torch.float32) / math.sqrt(dim)


def less_scores(train: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """LESS: cosine of each train feature with the mean of the normalised target features.

    Args:
        train: ``(n, d)`` gradient features of the training examples.
        target: ``(m, d)`` gradient features of the target examples.

    Returns:
        ``(n,)`` scores in [-1, 1].
    """
    t = torch.nn.functional.normalize(target.double(), dim=1).mean(0)          # (d,)
    x = torch.nn.functional.normalize(train.double(), dim=1)                   # (n, d)
    return x @ t / t.norm().clamp_min(1e-30)


def rbf_kernel(a: torch.Tensor, b: torch.Tensor, sigma: float) -> torch.Tensor:
    """``exp(-|a_i - b_j|² / (2 σ²))`` of ``(n, d)`` and ``(m, d)`` rows: ``(n, m)``."""
    return torch.exp(-torch.cdist(a.double(), b.double()).pow(2) / (2 * sigma**2))


def propagate(emb: torch.Tensor, landmarks: list[int], p_land: torch.Tensor, ridge: float) -> torch.Tensor:
    """Kernel-ridge propagation of landmark influences to every sample.

    Args:
        emb: ``(n, e)`` JVP embeddings of all samples.
        landmarks: Row indices of the landmarks in ``emb``.
        p_land: ``(L, m)`` influence of each landmark on each target example.
        ridge: Added to the kernel's diagonal, times the mean of that diagonal.

    Returns:
        ``(n, m)`` influences; landmarks get (close to) their own values.
    """
    e_l = emb[landmarks].double()
    dist = torch.cdist(e_l, e_l)
    off = dist[~torch.eye(len(landmarks), dtype=torch.bool)]
    sigma = float(off.median()) if off.numel() and float(off.median()) > 0 else 1.0
    k_ll = rbf_kernel(e_l, e_l, sigma)
    k_ll = k_ll + ridge * k_ll.diagonal().mean() * torch.eye(len(landmarks), dtype=torch.float64)
    return rbf_kernel(emb, e_l, sigma) @ torch.linalg.solve(k_ll, p_land.double())


def influence_scores(emb: torch.Tensor, landmarks: list[int], g_land: torch.Tensor, g_target: torch.Tensor,
                     ridge: float) -> torch.Tensor:
    """Influence Distillation (first order): ``p_L = Ĝ_L Ĝ_Tᵀ`` of L2-normalised landmark and
    target gradient features, propagated to all samples by :func:`propagate`: ``(n, m)``."""
    norm = torch.nn.functional.normalize
    p_land = norm(g_land.double(), dim=1) @ norm(g_target.double(), dim=1).T       # (L, m)
    return propagate(emb, landmarks, p_land, ridge)


def round_robin(influence: torch.Tensor, k: int, seed: int | None = None) -> list[int]:
    """Pick ``k`` samples: target examples take turns, each its best sample not yet taken.

    Args:
        influence: ``(n, m)`` influence of sample ``i`` on target example ``j``.
        k: How many to pick.
        seed: Shuffle the order of the target examples afresh every round (the released code;
            a fixed order favours the low-index targets when ``k mod m ≠ 0``): round ``r`` takes
            them in the order of the ``r``-th ``torch.randperm(m)`` of a generator seeded with
            ``seed``. ``None``: the fixed order ``0..m-1``.

    Returns:
        The picked indices in increasing order.
    """
    n, m = influence.shape
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    orders = [torch.argsort(-influence[:, j], stable=True).tolist() for j in range(m)]
    cursor, taken, out = [0] * m, set(), []
    while len(out) < k:
        for j in (range(m) if gen is None else torch.randperm(m, generator=gen).tolist()):
            while orders[j][cursor[j]] in taken:
                cursor[j] += 1
            taken.add(orders[j][cursor[j]])
            out.append(orders[j][cursor[j]])
            if len(out) == k:
                break
    return sorted(out)


def project_budget(y: torch.Tensor, total: float, iters: int = 100) -> torch.Tensor:
    """Euclidean projection of ``y`` onto ``{0 <= w <= 1, Σ w = total}``: ``clip(y - τ, 0, 1)``
    with ``τ`` found by bisection (the sum is monotone in ``τ``)."""
    lo, hi = float(y.min()) - 1.0, float(y.max())
    for _ in range(iters):
        tau = (lo + hi) / 2
        if float((y - tau).clamp(0, 1).sum()) > total:
            lo = tau
        else:
            hi = tau
    return (y - (lo + hi) / 2).clamp(0, 1)


def simplex_project(y: torch.Tensor, total: float) -> torch.Tensor:
    """Euclidean projection of ``y`` onto ``{w ≥ 0, Σw = total}`` (sort and threshold)."""
    u = torch.sort(y.double(), descending=True).values
    css = torch.cumsum(u, 0) - total
    idx = torch.arange(1, len(u) + 1, dtype=torch.float64)
    rho = int(torch.nonzero(u - css / idx > 0).max())
    return (y.double() - css[rho] / (rho + 1)).clamp_min(0)


def influence_weights(influence: torch.Tensor, k: float, eta: float = 1.0, l2: float = 1.0,
                      iters: int = 3000) -> torch.Tensor:
    """Influence Distillation's weights (arXiv 2505.19051, §3: one GD step of size ``η`` on the
    ``w``-weighted source loss, target loss to second order): with ``P`` the ``(n, m)``
    influences of the ``n`` candidates on the ``m`` target examples (normalised gradient
    products), ``p = P 1/m = G_S g_T`` and the target Hessian read as the empirical Fisher of the
    target gradients, ``H_T = G_Tᵀ G_T / m`` (so ``G_S H_T G_Sᵀ = P Pᵀ / m`` needs no more
    gradients), the paper's ``-(η/n) pᵀw + ½ (η/n)² wᵀ G_S H_T G_Sᵀ w`` times ``n/η`` plus its L2
    term is solved:

        min_w  -pᵀw + (η / 2nm) |Pᵀw|² + (l2 · std(p) / 2) |w|²   s.t.  w ≥ 0, Σw = k

    by accelerated projected gradient (:func:`simplex_project`). ``η = 0`` leaves the first-order
    term plus L2, ``max(p / (l2 std p) - τ, 0)``.

    Args:
        influence: ``(n, m)``.
        k: The weights' sum.
        eta: ``η``, the strength of the second-order term (the features are unit-norm, so it is
            relative to the first-order one).
        l2: The L2 weight in units of ``std(p)``.
        iters: Solver steps.

    Returns:
        ``(n,)`` weights, ``float64``.
    """
    P = influence.double()
    n, m = P.shape
    p = P.mean(1)
    lam = l2 * (float(p.std()) if n > 1 and float(p.std()) > 0 else 1.0)
    c = eta / (n * m)
    grad = lambda w: -p + c * (P @ (P.T @ w)) + lam * w  # noqa: E731
    lip = c * float(torch.linalg.matrix_norm(P, ord=2)) ** 2 + lam
    w = simplex_project(p / lam, float(k))
    y, t = w.clone(), 1.0
    for _ in range(iters):
        w_next = simplex_project(y - grad(y) / lip, float(k))
        t_next = (1 + math.sqrt(1 + 4 * t * t)) / 2
        y = w_next + ((t - 1) / t_next) * (w_next - w)
        w, t = w_next, t_next
    return w


def qcs_objective(masks: torch.Tensor, train: torch.Tensor, g_target: torch.Tensor, eta: float) -> torch.Tensor:
    """The qcs-proxy's stand-in for QCS's inner problem (not the paper's bi-level training): the
    target loss change after one step of size ``eta``
    on the masked mean gradient, to second order with an identity Hessian:
    ``Φ(m) = -eta gᵀu + eta²/2 |u|²``, ``u = Σ m_i g_i / max(Σ m, 1)``. ``masks``: ``(S, n)``."""
    u = masks.double() @ train.double() / masks.sum(1, keepdim=True).clamp_min(1.0)   # (S, d)
    return -eta * u @ g_target.double() + 0.5 * eta**2 * u.pow(2).sum(1)


def qcs_probabilities(train: torch.Tensor, target: torch.Tensor, k: int, steps: int, samples: int,
                      lr: float, eta: float, seed: int) -> torch.Tensor:
    """The qcs-proxy's sequence-level solver: projected REINFORCE on Bernoulli inclusion
    probabilities (of :func:`qcs_objective`, a proxy of QCS's inner training).

    ``∇_w E[Φ(m)] ≈ mean_s (Φ(m_s) - b) (m_s/w - (1-m_s)/(1-w))``, ``b`` the mean of the
    samples (a baseline), then ``w ← Π(w - lr ∇ / std(Φ))`` with Π :func:`project_budget`.
    No gradient flows through the model: only the sampled objective values are used.

    Args:
        train: ``(n, d)`` training features (gradients); target: ``(m, d)``.
        k: The budget (``Σ w = k`` holds after every step).

    Returns:
        ``(n,)`` inclusion probabilities.
    """
    gen = torch.Generator().manual_seed(seed)
    n = train.shape[0]
    g_t = target.double().mean(0)
    w = torch.full((n,), k / n, dtype=torch.float64)
    for _ in range(steps):
        wc = w.clamp(1e-3, 1 - 1e-3)
        m = (torch.rand(samples, n, generator=gen, dtype=torch.float64) < wc).double()   # (S, n)
        phi = qcs_objective(m, train, g_t, eta)                                           # (S,)
        adv = (phi - phi.mean()) / phi.std().clamp_min(1e-12)
        grad = (adv[:, None] * (m / wc - (1 - m) / (1 - wc))).mean(0)
        w = project_budget(w - lr * grad, float(k))
    return w


def token_weights(token_scores: list[torch.Tensor], ratio: float, floor: float) -> list[torch.Tensor]:
    """The qcs-proxy's token masks (QCS learns them; these are fixed by a score): per sequence
    the top ``ratio`` share of tokens by score weigh ``1 - floor``, the rest ``floor``."""
    out = []
    for s in token_scores:
        keep = max(1, round(ratio * len(s)))
        w = torch.full((len(s),), floor, dtype=torch.float32)
        w[torch.argsort(-s, stable=True)[:keep]] = 1 - floor
        out.append(w)
    return out


class WeightedData:
    """Training examples with a weight per example (and optionally per token).

    Items gain ``weight`` (and ``token_weight``, one per input token); the task's collate turns
    them into ``weights`` / ``token_weights`` and its loss multiplies each term by them. Every
    other attribute is the wrapped data's.
    """

    def __init__(self, data, weights: list[float] | None, token_weights: list[list[float]] | None = None):
        self.data, self.weights, self.token_weights = data, weights, token_weights

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        item = dict(self.data[i])
        item["weight"] = 1.0 if self.weights is None else float(self.weights[i])
        if self.token_weights is not None:
            item["token_weight"] = self.token_weights[i]
        return item

    def __getattr__(self, name: str):
        return getattr(self.__dict__["data"], name)


__all__ = ["WeightedData", "influence_scores", "budget_count", "random_scores",
           "top_k", "less_scores", "propagate", "round_robin", "project_budget", "simplex_project",
           "influence_weights", "qcs_probabilities", "qcs_objective", "token_weights", "projection_block",
           "rbf_kernel"]
