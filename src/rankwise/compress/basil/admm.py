"""3BASiL: ``W ≈ S + L·R`` by 3-block ADMM on the layer reconstruction objective."""
from __future__ import annotations

import torch

from rankwise.compress.base import Compressed, Compressor, damped
from rankwise.compress.formats import decode_sparse, encode_sparse
from rankwise.compress.pattern import keep_mask


class _Problem:
    """The scaled layer problem ``min ½ tr((W̃ − S̃ − M) Ĥ (W̃ − S̃ − M)ᵀ)``.

    With ``x = sqrt(diag H)``, ``D = diag(x)``: ``W̃ = W D``, ``Ĥ = D⁻¹ H D⁻¹ = Q Λ Qᵀ``.
    ``S̃ = S D`` has the sparsity pattern of ``S``, so a magnitude projection in the scaled
    space ranks entries by ``|S_ij| · sqrt(H_jj)`` (Wanda's score).
    """

    def __init__(self, weight: torch.Tensor, hessian: torch.Tensor, damp: float, diag_damp: float):
        h = damped(hessian, damp)
        h += diag_damp * torch.diag(torch.diagonal(h))
        self.x = torch.sqrt(torch.diagonal(h))                                 # (in,)
        hs = h / (self.x[:, None] * self.x[None, :])
        lam, q = torch.linalg.eigh(hs.float())        # unit diagonal, damped: float32 suffices
        lam = lam.clamp(min=1e-12)
        self.lam, self.q = lam.float(), q.float()
        self.hs = hs.float()
        self.w = (weight.double() * self.x[None, :]).float()                    # W̃ (out, in)
        self.root = self.q * torch.sqrt(self.lam)[None, :]                      # Q Λ^{1/2}
        self.inv_root = self.q / torch.sqrt(self.lam)[None, :]                  # Q Λ^{-1/2}
        self.norm = float(self.objective(torch.zeros_like(self.w), torch.zeros_like(self.w)))

    def objective(self, s: torch.Tensor, m: torch.Tensor) -> float:
        """``½ tr(R Ĥ Rᵀ)`` with ``R = W̃ − S − M``."""
        r = self.w - s - m
        return 0.5 * float(((r @ self.hs) * r).double().sum())

    def lowrank(self, e: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact ``argmin_{rank ≤ r} ½ tr((E − M) Ĥ (E − M)ᵀ)`` as ``(L, R)``: the rank-r SVD
        of ``E Q Λ^{1/2}`` mapped back by ``Λ^{-1/2} Qᵀ``; ``√σ`` goes to each factor."""
        u, s, vh = torch.linalg.svd(e.double() @ self.root.double(), full_matrices=False)
        root = torch.sqrt(s[:r])
        return (u[:, :r] * root).float(), ((root[:, None] * vh[:r]) @ self.inv_root.double().T).float()


class _WarmSubspace:
    """The same low-rank fit by one step of subspace iteration per call, warm-started from the
    previous call's right singular vectors (ADMM changes ``E`` a little per iteration)."""

    def __init__(self, problem: _Problem, rank: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.p, self.rank = problem, rank
        self.v = torch.randn(problem.w.shape[1], min(rank + 4, min(problem.w.shape)), generator=g)

    def fit(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L, R)`` of the rank-r fit of ``E`` under ``Ĥ``."""
        p, r = self.p, self.rank
        y, _ = torch.linalg.qr(e @ (p.root @ self.v))                           # (out, k)
        ub, s, vh = torch.linalg.svd((y.T @ e) @ p.root, full_matrices=False)  # (k, k), (k, in)
        self.v = vh.T
        root = torch.sqrt(s[:r])
        return (y @ ub[:, :r]) * root, (root[:, None] * vh[:r]) @ p.inv_root.T


class ThreeBasil(Compressor):
    """3BASiL-TM (arXiv 2603.01376; released code ``mazumder-lab/3BASiL``): for each linear layer

        min_{S, L, R} ½ tr((W − S − LR) H (W − S − LR)ᵀ)   s.t. S sparse (k-sparse or N:M)

    by a 3-block ADMM over a dense copy ``B`` of ``S``, its sparse copy ``Dₛ`` and the
    low-rank block ``M = LR``, with scaled dual ``V`` (released code ``threebasil()``; paper
    Alg. 1), in the diagonally scaled space of :class:`_Problem`:

        B  ← [(W̃ − M) Ĥ − V + ρ Dₛ] (Ĥ + ρI)⁻¹        (Ĥ = QΛQᵀ: one eigendecomposition)
        Dₛ ← Π_sparse(B + V/ρ)                         (magnitude top-k, layer-wise, or N:M)
        V  ← V + ρ (B − Dₛ)
        M  ← argmin_{rank ≤ r} ½ tr((W̃ − B − M) Ĥ (·)ᵀ)   (weighted low-rank regression)

    Every ``check_every`` iterations ρ grows by ×1.1 / ×1.05 / ×1.02 when more than 10% /
    0.5% / any of the support flipped (a simplified form of the released schedule), and the
    loop stops after ``min_iterations`` once the support is stable.

    Choices where the sources leave room (documented in ``docs/compression.md``):

    * the low-rank step uses one warm-started subspace iteration per ADMM step instead of a
      fresh randomized SVD (same fixed point, deterministic);
    * at the end, the sparse support is the better of ``Π(B)`` and ``Dₛ`` by the objective,
      and ``L·R`` is refit exactly to it (one extra closed-form step; it can only lower the
      objective for that support);
    * transformer matching (TM, :func:`rankwise.compress.basil.tm.transformer_matching`) trains
      ``S`` (masked), ``L`` and ``R`` only, with every pruned entry masked in the forward pass,
      so TM cannot densify ``S``; the released code's pure-pruning path leaves the mask off.
    """

    @property
    def refines_blocks(self) -> bool:  # type: ignore[override]
        """Transformer matching runs when ``tm_epochs > 0``."""
        return self.config.tm_epochs > 0

    def project(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``Π_sparse(Z)``: keep the largest magnitudes (whole layer, or N of each M)."""
        c = self.config
        keep = keep_mask(z.abs(), c.sparsity, c.nm, group="layer")
        return z * keep, keep

    def solve(self, weight: torch.Tensor, hessian: torch.Tensor):
        """Run the ADMM on one layer.

        Returns:
            ``(S, keep, L, R, info)`` in the original (unscaled) space; ``info`` holds the
            relative objective at each check (``objective``), the prune-then-compensate
            starting value (``objective_prune_refit``), iterations and the final ρ.
        """
        c = self.config
        p = _Problem(weight, hessian, c.damp, c.diag_damp)
        rel = lambda s, m: p.objective(s, m) / max(p.norm, 1e-30)  # noqa: E731
        ds, keep = self.project(p.w)
        b, v = ds.clone(), torch.zeros_like(ds)
        m = torch.zeros_like(ds)
        sub = _WarmSubspace(p, c.rank, c.seed)
        start_l, start_r = p.lowrank(p.w - ds, c.rank)
        history = [rel(ds, m)]
        rho, prev_keep, it = c.rho, keep, 0

        def inverse(rho: float) -> torch.Tensor:                               # (Ĥ + ρI)⁻¹
            return (p.q / (p.lam + rho)) @ p.q.T

        k = inverse(rho)
        for it in range(1, c.iterations + 1):
            # B = [(W̃ − M)Ĥ − V + ρDₛ](Ĥ + ρI)⁻¹ = (W̃ − M) + [ρ(Dₛ − W̃ + M) − V](Ĥ + ρI)⁻¹
            b = (p.w - m) + (rho * (ds - p.w + m) - v) @ k
            ds, keep = self.project(b + v / rho)
            v += rho * (b - ds)
            left, right = sub.fit(p.w - b)
            m = left @ right
            if it % c.check_every == 0:
                flips = int((keep ^ prev_keep).sum())
                ratio = flips / max(int(keep.sum()), 1)
                prev_keep = keep
                history.append(rel(ds, m))
                if it >= c.min_iterations and ratio < 3e-4:
                    break
                grow = 1.1 if ratio > 0.1 else 1.05 if ratio > 0.005 else 1.02 if flips else 1.0
                if grow > 1.0 and rho < 1e6:
                    rho = min(rho * grow, 1e6)
                    k = inverse(rho)
        candidates = []
        for s_final, k_final in (self.project(b), (ds, keep)):
            left, right = p.lowrank(p.w - s_final, c.rank)
            candidates.append((p.objective(s_final, left @ right), s_final, k_final, left, right))
        obj, s_final, keep, left, right = min(candidates, key=lambda t: t[0])
        history.append(obj / max(p.norm, 1e-30))
        info = {"objective": history, "objective_prune_refit": rel(self.project(p.w)[0], start_l @ start_r),
                "iterations": it, "rho": rho}
        x = p.x.float()
        return s_final / x[None, :], keep, left, right / x[None, :], info

    def encode(self, s: torch.Tensor, keep: torch.Tensor, left: torch.Tensor,
               right: torch.Tensor, info: dict | None = None) -> Compressed:
        """Store ``S`` (sparse) and ``L``, ``R``; the weight is their decoded sum."""
        tensors = encode_sparse(s, keep, self.config.nm, self.value_dtype)
        tensors["L"] = left.to(self.value_dtype).contiguous()
        tensors["R"] = right.to(self.value_dtype).contiguous()
        shape = tuple(s.shape)
        nnz = int(keep.sum())
        info = {**(info or {}), "sparsity": 1.0 - nnz / keep.numel(), "rank": int(left.shape[1])}
        return Compressed(tensors, self.decode(tensors, shape), nnz + left.numel() + right.numel(), info)

    def compress(self, weight, hessian):
        """ADMM, then encode."""
        s, keep, left, right, info = self.solve(weight, hessian)
        return self.encode(s, keep, left, right, info)

    def decode(self, tensors, shape):
        """``S + L @ R``."""
        return decode_sparse(tensors, shape, self.config.nm) + tensors["L"].float() @ tensors["R"].float()

    def refine_block(self, block, layers, forward, targets):
        """Transformer matching of the whole block (when ``tm_epochs > 0``)."""
        from rankwise.compress.basil.tm import transformer_matching
        return transformer_matching(self, block, layers, forward, targets)
