"""The fixed-rank manifold ``{W = U S V^T : rank r}`` in factored form: Riemannian gradients,
the truncated-SVD retraction with basis augmentation, and vector transport by projection.

Notation: ``U`` (m x r) and ``V`` (n x r) have orthonormal columns, ``S`` (r x r). A tangent
vector at ``W`` is kept as ``(C, Up, Vp)`` with ``xi = U C V^T + Up V^T + U Vp^T``,
``U^T Up = 0``, ``V^T Vp = 0`` (Vandereycken 2013, Prop. 2.1): ``r^2 + (m + n) r`` numbers, the
size of the factors themselves. Nothing here forms an ``m x n`` matrix.
"""
from __future__ import annotations

import torch

Tangent = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (C (r, r), Up (m, r), Vp (n, r))


def diagonal_pinv(s: torch.Tensor, rtol: float = 1e-6) -> torch.Tensor:
    """Pseudo-inverse of a diagonal ``S``: ``1 / s_i`` where ``s_i > rtol * max |s|``, else 0."""
    d = torch.diagonal(s)
    keep = d.abs() > rtol * d.abs().max()
    return torch.diag(torch.where(keep, 1.0 / torch.where(keep, d, torch.ones_like(d)), torch.zeros_like(d)))


def riemannian_gradient(u: torch.Tensor, s: torch.Tensor, v: torch.Tensor, grad_u: torch.Tensor,
                        grad_s: torch.Tensor, grad_v: torch.Tensor) -> Tangent:
    """Project the Euclidean gradient ``G = dL/dW`` onto the tangent space at ``U S V^T``,
    reading ``G V``, ``G^T U`` and ``U^T G V`` off the factors' own gradients.

    With ``y = ((x V) S^T) U^T`` autograd gives ``dU = G V S^T``, ``dS = U^T G V``,
    ``dV = G^T U S``, so ``G V = dU S^{+T}`` and ``G^T U = dV S^+`` (``S`` is diagonal here; the
    pseudo-inverse drops directions whose singular value is 0, e.g. ``S = 0`` at an adapter's
    start, where only ``dS`` carries information). Because everything comes from the factors'
    gradients, DDP's gradient averaging is all the synchronisation needed.

    Returns:
        ``(U^T G V, (I - U U^T) G V, (I - V V^T) G^T U)``: ``P_T(G)`` in factored form.
    """
    pinv = diagonal_pinv(s)
    gv = grad_u @ pinv.T                                   # (m, r) ~ G V
    gtu = grad_v @ pinv                                    # (n, r) ~ G^T U
    return grad_s, gv - u @ (u.T @ gv), gtu - v @ (v.T @ gtu)


def _canonical(u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flip column pairs so each column of ``u`` has its largest-magnitude entry positive (the
    SVD's signs are arbitrary; this makes the factors a function of ``W``, equal on every
    process)."""
    idx = u.abs().argmax(dim=0, keepdim=True)
    sign = torch.sign(u.gather(0, idx))
    sign[sign == 0] = 1
    return u * sign, v * sign


def retract(u: torch.Tensor, s: torch.Tensor, v: torch.Tensor, t: Tangent, lr: float,
            rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``R(W - lr xi)``: the best rank-``r`` approximation of the step, by basis augmentation
    and truncation.

    ``W - lr xi = [U, Up] [[S - lr C, -lr I], [-lr I, 0]] [V, Vp]^T`` has rank at most ``2r``:
    the bases are augmented, ``U_hat = qr([U, Up])``, ``V_hat = qr([V, Vp])``, the step is written
    as a ``2r x 2r`` core in them, and the core's SVD truncated to ``r`` gives the new factors.
    ``U`` and ``V`` need only span their subspaces (not be orthonormal) for this to be exact.

    Returns:
        ``(U', S', V')`` with orthonormal ``U'``, ``V'`` and diagonal ``S' >= 0`` (descending).
    """
    c, up, vp = t
    uh = torch.linalg.qr(torch.cat([u, up], dim=1))[0]     # (m, k1), k1 = min(m, 2r)
    vh = torch.linalg.qr(torch.cat([v, vp], dim=1))[0]     # (n, k2)
    a, b = uh.T @ u, vh.T @ v                              # coordinates of U, V in the new bases
    core = a @ (s - lr * c) @ b.T - lr * (uh.T @ up) @ b.T - lr * a @ (vh.T @ vp).T   # (k1, k2)
    p, sig, qh = torch.linalg.svd(core)
    new_u, new_v = _canonical(uh @ p[:, :rank], vh @ qh[:rank].T)
    return new_u, torch.diag(sig[:rank]), new_v


def transport(u: torch.Tensor, v: torch.Tensor, new_u: torch.Tensor, new_v: torch.Tensor,
              t: Tangent) -> Tangent:
    """Move a tangent vector at ``U S V^T`` to the tangent space at the new point by orthogonal
    projection (the vector transport of embedded submanifolds, Absil et al. 2008, Sec. 8.1):
    the part of the momentum that the new tangent space cannot represent is dropped.

    Returns:
        ``P_{T(W')}(xi)`` as ``(C', Up', Vp')`` in the new factors' coordinates.
    """
    c, up, vp = t
    a = new_u.T @ u                                        # (r, r)
    b = v.T @ new_v                                        # (r, r)
    xi_v = u @ (c @ b) + up @ b + u @ (vp.T @ new_v)       # xi V'      (m, r)
    xi_t_u = v @ (c.T @ a.T) + v @ (up.T @ new_u) + vp @ a.T   # xi^T U'  (n, r)
    core = new_u.T @ xi_v
    return core, xi_v - new_u @ core, xi_t_u - new_v @ core.T


def tangent_numel(shape: tuple[int, int], rank: int) -> int:
    """Numbers in one tangent vector of an ``m x n`` rank-``r`` point: ``r^2 + (m + n) r``."""
    return rank * rank + (shape[0] + shape[1]) * rank
