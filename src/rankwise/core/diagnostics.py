"""Method-agnostic maths behind ``rankwise inspect`` (docs/inspect.md): spectra, Model Shapley
values and the perturbation bound of a low-rank inverse.

Three pieces, each a pure function over tensors so the tests can check it against a known answer:

* **Effective rank** of a matrix from its singular values ``s``: the entropy rank
  ``exp(H(s / sum s))`` (Roy & Vetterli 2007) and the energy ranks, the smallest ``k`` with
  ``sum_{i<=k} s_i^2 >= q * sum s_i^2`` for ``q = 0.9, 0.99``.
* **Model Shapley** (NeurIPS 2025; docs/inspect.md): a parameter is a player and removing it zeroes it.
  Expanding the loss at the trained ``θ`` to second order, the cost of removing a coalition S is
  ``c(S) = -Σ_{i∈S} g_i θ_i + ½ Σ_{i,j∈S} H_ij θ_i θ_j`` (Thm 4.4 with ``w_ij = 1``); the
  Shapley value of that game, each pair's interaction split in halves, is (Thm 4.6 / Eq. 7)
  ``φ_i = -g_i θ_i + ½ θ_i (Hθ)_i``. The sign: ``+½`` in loss units (a large φ = the loss rises
  most when the parameter goes); the paper's Remark 4.7 writes ``-½ Θ·(HΘ)`` in utility units
  ``U = -L``, the same value with the opposite sign. The stored copy of the paper did not decode
  Eq. 7, so the sign was fixed here by exactness: for a quadratic loss the closed form equals
  the enumerated Shapley values (``tests/core/test_diagnostics.py``). At scale H is the
  block-diagonal empirical Fisher (one block per output neuron of a weight matrix, §4.3) and
  the per-batch values are smoothed by an EWMA (§4.2).
* **Low-rank inverse bound** (Tran & Vishnoi, NeurIPS 2025, arXiv 2510.25571): for SPD ``A``
  with eigenvalues ``λ_1 ≥ … ≥ λ_n > 0``, ``Ã = A + E`` and ``A_p^{-1}`` the best rank-p
  approximation of ``A^{-1}``: if ``4‖E‖ ≤ min(λ_n, δ_{n-p})`` with
  ``δ_{n-p} = λ_{n-p} - λ_{n-p+1}``, then
  ``‖(Ã^{-1})_p - A_p^{-1}‖ ≤ 4‖E‖/λ_n² + 5‖E‖/(λ_{n-p} δ_{n-p})`` (their Theorem 2.1 as the
  secondary summary in the notes states it; the stored seed holds only the abstract).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn


def effective_ranks(s: torch.Tensor) -> dict[str, float]:
    """Entropy and energy effective ranks of a spectrum.

    Args:
        s: Singular values (any order, non-negative).

    Returns:
        ``{"entropy": exp(-Σ p log p) with p = s / Σ s, "energy90": k, "energy99": k,
        "dim": len(s)}``; an all-zero spectrum has every rank 0.
    """
    s = s.detach().double().flatten().clamp_min(0).sort(descending=True).values
    total = float(s.sum())
    if total <= 0:
        return {"entropy": 0.0, "energy90": 0, "energy99": 0, "dim": len(s)}
    p = s / total
    p = p[p > 0]
    entropy = math.exp(float(-(p * p.log()).sum()))
    energy = (s ** 2).cumsum(0) / float((s ** 2).sum())

    def rank_at(q: float) -> int:  # smallest k reaching q of the energy (1e-12 for rounding)
        return int((energy < q - 1e-12).sum()) + 1

    return {"entropy": entropy, "energy90": rank_at(0.9), "energy99": rank_at(0.99), "dim": len(s)}


def mean_gradients(model: nn.Module, params: dict[str, nn.Parameter], batches: list[dict],
                          loss_fn: Callable[[nn.Module, dict], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mean over ``batches`` of d loss / d W for each weight in ``params``.

    Only ``params`` require grad while this runs; flags are restored and no ``.grad`` is left.

    Args:
        model: The model (not changed).
        params: ``{name: parameter}``.
        batches: Batch dicts on the model's device.
        loss_fn: ``loss_fn(model, batch) -> scalar`` mean loss.

    Returns:
        ``{name: mean gradient}`` in float32, the parameters' shapes.
    """
    flags = {p: p.requires_grad for p in model.parameters()}
    for p in flags:
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    acc = {k: torch.zeros_like(p, dtype=torch.float32) for k, p in params.items()}
    try:
        for batch in batches:
            grads = torch.autograd.grad(loss_fn(model, batch), list(params.values()), allow_unused=True)
            for k, g in zip(params, grads):
                if g is not None:
                    acc[k] += g.float()
    finally:
        for p, f in flags.items():
            p.requires_grad_(f)
    return {k: a / max(len(batches), 1) for k, a in acc.items()}


def shapley_quadratic(g: torch.Tensor, theta: torch.Tensor, h_theta: torch.Tensor) -> torch.Tensor:
    """Model Shapley's closed form ``φ = -g⊙θ + ½ θ⊙(Hθ)`` (Eq. 7; loss units, see the module).

    Args:
        g: The loss gradient at θ (any shape).
        theta: The parameters (same shape).
        h_theta: ``Hθ`` (same shape), H the Hessian or its Fisher stand-in.

    Returns:
        φ, same shape: the loss increase each parameter is owed when the coalition is removed.
    """
    return -g * theta + 0.5 * theta * h_theta


def fisher_rows_times_theta(per_example_grads: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """``Fθ`` for the block-diagonal empirical Fisher with one block per output row.

    ``F_row = (1/B) Σ_b g_b,row g_b,rowᵀ``, so ``(Fθ)_row = (1/B) Σ_b g_b,row (g_b,row · θ_row)``:
    cross-row (cross-neuron) and cross-layer entries are dropped (Model Shapley §4.3).

    Args:
        per_example_grads: ``(B, out, in)`` per-example gradients of one weight.
        theta: ``(out, in)`` the weight.

    Returns:
        ``(out, in)``.
    """
    dots = (per_example_grads * theta).sum(dim=-1, keepdim=True)  # (B, out, 1)
    return (per_example_grads * dots).mean(dim=0)


def split_batch(batch: dict) -> list[dict]:
    """One-example batches from a collated batch (tensors with a leading batch dim are split)."""
    n = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return [{k: v[i:i + 1] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n else v
             for k, v in batch.items()} for i in range(n)]


def shapley_scores(weights: dict[str, torch.Tensor], batches: Iterable[dict],
                   loss_fn: Callable[[dict], torch.Tensor], beta: float = 0.9,
                   transposed: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Per-parameter Model Shapley values of 2-D weights, EWMA over mini-batches.

    Per mini-batch t, from per-example gradients (one backward per example): ``g`` = their mean,
    ``Fθ`` the block-diagonal Fisher product (:func:`fisher_rows_times_theta`) and
    ``φ_t = -g⊙θ + ½ θ⊙Fθ``; then ``φ̂_t = β φ̂_{t-1} + (1-β) φ_t`` from ``φ̂_0 = 0``, divided by
    ``1 - β^t`` (bias correction: a constant φ_t gives φ_t back; ranks are unchanged by it).

    Args:
        weights: ``{name: (out, in) parameter}``; only these need ``requires_grad``.
        batches: Collated batch dicts.
        loss_fn: ``loss_fn(batch) -> scalar`` mean loss of the batch.
        beta: EWMA decay.
        transposed: Names whose weight is stored ``(in, out)`` (GPT-2's Conv1D): their Fisher
            blocks are the columns.

    Returns:
        ``{name: φ}`` in float32, each weight's own layout.
    """
    ewma = {k: torch.zeros_like(w, dtype=torch.float32) for k, w in weights.items()}
    transposed = set(transposed)
    flags = {k: w.requires_grad for k, w in weights.items()}
    for w in weights.values():
        w.requires_grad_(True)
    try:
        t = _shapley_ewma(weights, batches, loss_fn, beta, transposed, ewma)
    finally:
        for k, w in weights.items():
            w.requires_grad_(flags[k])
    if t == 0:
        raise ValueError("shapley_scores: got no batch; expected at least one calibration batch")
    return {k: v / (1 - beta ** t) for k, v in ewma.items()}


def _shapley_ewma(weights: dict[str, torch.Tensor], batches: Iterable[dict], loss_fn: Callable,
                  beta: float, transposed: set[str], ewma: dict[str, torch.Tensor]) -> int:
    """Fold each batch's φ into ``ewma`` in place; return the number of batches."""
    t = 0
    for batch in batches:
        per = {k: [] for k in weights}
        for one in split_batch(batch):
            grads = torch.autograd.grad(loss_fn(one), list(weights.values()), allow_unused=True)
            for k, gr in zip(weights, grads):
                per[k].append(torch.zeros_like(weights[k]) if gr is None else gr.detach().float())
        t += 1
        for k, w in weights.items():
            gb, theta = torch.stack(per[k]), w.detach().float()  # (B, out, in), (out, in)
            if k in transposed:  # stored (in, out): blocks along the columns
                ft = fisher_rows_times_theta(gb.transpose(-1, -2), theta.T).T
            else:
                ft = fisher_rows_times_theta(gb, theta)
            phi = shapley_quadratic(gb.mean(0), theta, ft)
            ewma[k].mul_(beta).add_(phi, alpha=1 - beta)
    return t


def neuron_scores(kind: str, weights: dict[str, nn.Parameter], batches: list[dict],
                  loss_fn: Callable[[dict], torch.Tensor], transposed: Iterable[str] = (),
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """One score per output neuron of each weight: the players of Model Shapley's selection.

    Args:
        kind: ``shapley`` (Σ_row φ: a neuron's Shapley value when the neuron is the player, as
            the quadratic game splits every cross-neuron pair in halves), ``grad`` (Σ_row |ḡ|),
            ``grad_weight`` (Σ_row |ḡ⊙θ|, the first-order Taylor score) or ``random``.
        weights: ``{name: parameter}`` (``(out, in)``, or ``(in, out)`` when in ``transposed``).
        batches: Calibration batches.
        loss_fn: ``loss_fn(batch) -> scalar`` mean loss.
        transposed: Names stored ``(in, out)``.
        seed: For ``random``.

    Returns:
        ``{name: (out,) scores}``; higher = keep training it.

    Raises:
        ValueError: On an unknown ``kind``.
    """
    transposed = set(transposed)

    def per_neuron(k: str, t: torch.Tensor) -> torch.Tensor:
        return t.sum(0) if k in transposed else t.sum(-1)

    if kind == "random":
        gen = torch.Generator().manual_seed(seed)
        return {k: torch.rand(w.shape[1] if k in transposed else w.shape[0], generator=gen)
                for k, w in weights.items()}
    if kind == "shapley":
        phi = shapley_scores(weights, batches, loss_fn, transposed=transposed)
        return {k: per_neuron(k, v) for k, v in phi.items()}
    if kind not in ("grad", "grad_weight"):
        raise ValueError(f"neuron_scores: got {kind!r}; expected shapley, grad, grad_weight or random")
    holder = nn.Module()  # mean_gradients takes a model: the weights alone are enough
    for i, w in enumerate(weights.values()):
        holder.register_parameter(f"w{i}", w)
    g = mean_gradients(holder, weights, batches, lambda _m, b: loss_fn(b))
    return {k: per_neuron(k, (g[k] if kind == "grad" else g[k] * weights[k].detach().float()).abs())
            for k in weights}


def lowrank_inverse(a: torch.Tensor, p: int) -> torch.Tensor:
    """The best rank-p approximation of ``A^{-1}`` for SPD ``A`` (its p smallest eigenpairs)."""
    lam, u = torch.linalg.eigh(a.double())  # ascending: the largest 1/λ come first
    return (u[:, :p] / lam[:p]) @ u[:, :p].T


def inverse_bounds(a: torch.Tensor, e: torch.Tensor, p: int) -> dict[str, float | bool | None]:
    """Measured ``‖(Ã^{-1})_p - A_p^{-1}‖₂`` against the paper's bound and the naive one.

    The naive bound (our reading of "Neumann + Eckart–Young", stated in docs/inspect.md):
    ``‖Ã^{-1} - A^{-1}‖ ≤ ‖E‖ / (λ_n (λ_n - ‖E‖))`` (Neumann series) plus the two truncation
    errors ``σ_{p+1}(Ã^{-1}) ≤ 1/(λ_{n-p} - ‖E‖)`` (Weyl) and ``σ_{p+1}(A^{-1}) = 1/λ_{n-p}``
    (Eckart–Young), by the triangle inequality.

    Args:
        a: SPD ``(n, n)``.
        e: Symmetric perturbation ``(n, n)``.
        p: Rank, ``1 <= p < n``.

    Returns:
        ``{"p", "norm_e", "lambda_n", "gap", "measured", "bound" (None when the paper's
        condition 4‖E‖ ≤ min(λ_n, δ) fails), "applies", "naive" (None when ‖E‖ ≥ λ_n)}``.

    Raises:
        ValueError: If p is outside ``[1, n)`` or A is not positive definite.
    """
    n = a.shape[0]
    if not 1 <= p < n:
        raise ValueError(f"inverse_bounds: got p={p}; expected 1 <= p < n={n}")
    a, e = a.double(), e.double()
    lam = torch.linalg.eigvalsh(a).flip(0)  # λ_1 >= ... >= λ_n
    if float(lam[-1]) <= 0:
        raise ValueError("inverse_bounds: A is not positive definite; add a damping term")
    norm_e = float(torch.linalg.matrix_norm(e, 2))
    ln, l_np, l_np1 = float(lam[-1]), float(lam[n - p - 1]), float(lam[n - p])
    gap = l_np - l_np1
    measured = float(torch.linalg.matrix_norm(lowrank_inverse(a + e, p) - lowrank_inverse(a, p), 2))
    applies = 4 * norm_e <= min(ln, gap)
    bound = 4 * norm_e / ln ** 2 + 5 * norm_e / (l_np * gap) if applies else None
    naive = None
    if norm_e < ln:
        naive = norm_e / (ln * (ln - norm_e)) + 1 / (l_np - norm_e) + 1 / l_np
    return {"p": p, "norm_e": norm_e, "lambda_n": ln, "gap": gap, "measured": measured,
            "bound": bound, "applies": applies, "naive": naive}
