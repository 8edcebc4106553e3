"""Streaming subspace tracking for the projector: a block-Oja step every optimizer step, with
optional unbiased stochastic quantization of the tracker (``projector: oja``, ``oja_bits``).

Reading of "Low-Precision Streaming PCA" (Dasgupta, Kumar, Pandey, Sarkar; NeurIPS 2025,
arXiv 2510.22440). The paper's batched update and the exact placement of its quantizers were
not available to us; the abstract says Oja's algorithm "with unbiased stochastic quantization of
the weight vector and the updates", for the top-1 eigenvector. Our reading, for the top-``r``
left subspace of a stream of ``d x k`` matrices ``A_t`` (the gradient, or its transpose, so that
``d = min(m, n)`` as in :mod:`rankwise.optim.projector`):

1. ``Y = A (A^T Q)`` - one step of Oja's rule on the sample covariance ``A A^T`` (``O(d k r)``);
2. ``Q <- Q + eta Y / e`` with ``e = ||A^T Q||_F^2 / r``, the mean energy the tracked directions
   capture, so ``eta`` is dimensionless (``eta = 1`` moves a direction by about its share of
   the tracked energy per step, whatever the gradient's scale);
3. ``Q, R = qr(Q)`` with the columns' signs chosen so that ``diag(R) > 0`` (the block
   generalisation of Oja's normalisation; the sign rule keeps ``Q`` continuous from step to
   step, so moments kept in ``Q``'s coordinates stay meaningful, and makes ``Q`` a
   deterministic function of the gradients on every DDP process);
4. with ``bits``: the update ``eta Y / e`` is stochastically rounded before step 2, and ``Q``
   after step 3 (linear grid, one scale per column, ``E[Q(x)] = x``); ``Q`` is stored as int8
   codes plus the column scales.

The tracker starts from the exact top-``r`` subspace of the first gradient (one
eigendecomposition); after that no SVD is ever computed. On a stationary stream (a fixed
``E[A A^T]`` with a gap after the ``r``-th eigenvalue) step 1-3 is block power iteration on
``I + eta E[A A^T] / e`` in expectation, whose fixed point is the top-``r`` eigenspace.
"""
from __future__ import annotations

import torch

from rankwise.optim import projector

SUPPORTED_BITS = range(2, 9)  # codes are int8: 2..8 bits


def stochastic_round(x: torch.Tensor, bits: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased stochastic quantization of the columns of ``x`` to a symmetric ``bits``-bit grid.

    Each column ``j`` gets the scale ``s_j = max_i |x_ij| / (2^(bits-1) - 1)``; an entry is
    rounded down or up to a neighbouring grid point with probabilities that make
    ``E[code * s] = x`` exactly (``floor(x / s + u)``, ``u ~ U[0, 1)``).

    Args:
        x: A ``(d, r)`` float tensor.
        bits: Bits per code, 2..8.
        generator: Random source (CPU generator; the noise is drawn on CPU and moved).

    Returns:
        ``(codes, scale)``: int8 ``(d, r)`` and float ``(r,)`` with ``codes * scale ~ x``.
    """
    levels = 2 ** (bits - 1) - 1
    scale = x.abs().amax(dim=0).clamp_min(torch.finfo(x.dtype).tiny) / levels   # (r,)
    noise = torch.rand(x.shape, generator=generator, dtype=x.dtype).to(x.device)
    codes = torch.floor(x / scale + noise).clamp_(-levels, levels)
    return codes.to(torch.int8), scale


def _orthonormalize(q: torch.Tensor) -> torch.Tensor:
    """QR with the signs fixed so that ``diag(R) > 0`` (a continuous, unique orthonormal basis)."""
    qq, rr = torch.linalg.qr(q.float())
    sign = torch.sign(torch.diagonal(rr))
    sign[sign == 0] = 1
    return (qq * sign).to(q.dtype)


def _store(state: dict, q: torch.Tensor, bits: int | None, generator: torch.Generator | None) -> None:
    if bits:
        state["proj_basis"], state["proj_scale"] = stochastic_round(q, bits, generator)
    else:
        state["proj_basis"] = q.contiguous()


def track(state: dict, grad: torch.Tensor, rank: int, lr: float = 1.0, bits: int | None = None,
          generator: torch.Generator | None = None, method: str = "eigh") -> torch.Tensor | None:
    """Move the basis in ``state`` one block-Oja step toward ``grad``'s top-``r`` subspace.

    Args:
        state: The parameter's optimizer state (``proj_side``, ``proj_basis`` and, quantized,
            ``proj_scale``; created on the first call).
        grad: The ``m x n`` gradient.
        rank: Subspace dimension ``r``.
        lr: ``eta``, the dimensionless Oja step (see the module docstring).
        bits: Quantize the tracker and its update to this many bits (``None``: float).
        generator: Random source of the stochastic rounding.
        method: How the first basis is computed (:func:`rankwise.optim.projector.spectrum`).

    Returns:
        The previous basis (float; ``None`` on the first call or in IDENTITY mode), for callers
        that transport moments (SUMO).
    """
    if "proj_side" not in state:
        state["proj_side"] = torch.tensor(projector.choose_side(grad.shape, rank), dtype=torch.int64)
    side = int(state["proj_side"])
    if side == projector.IDENTITY:
        return None
    a = grad if side == projector.LEFT else grad.T          # (d, k), d = min(m, n)
    old = projector.basis(state)
    if old is None:
        u, _ = projector.spectrum(a, method)
        q = projector._canonical_signs(u[:, :rank]).to(grad.dtype)
    else:
        proj = a.T @ old                                      # (k, r)
        energy = proj.square().sum() / rank
        if not bool(energy > 0):
            return old
        step = (a @ proj).mul_(lr / energy)                   # (d, r)
        if bits:
            codes, scale = stochastic_round(step, bits, generator)
            step = codes.to(step.dtype) * scale
        q = _orthonormalize(old + step)
    _store(state, q, bits, generator)
    return old


def principal_angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Principal angles (radians, ascending) between the column spans of ``a`` and ``b``.

    Args:
        a: ``(d, r)``; its columns need not be orthonormal.
        b: ``(d, s)``.

    Returns:
        ``min(r, s)`` angles in ``[0, pi/2]``.
    """
    qa, _ = torch.linalg.qr(a.double())
    qb, _ = torch.linalg.qr(b.double())
    cos = torch.linalg.svdvals(qa.T @ qb).clamp(-1, 1)
    return torch.arccos(cos)




def projector_problems(projector_name: str, oja_bits: int | None) -> list[str]:
    """The error of ``oja_bits`` set without ``projector: oja`` (empty when valid); the ranges of
    ``oja_lr`` (> 0) and ``oja_bits`` (:data:`SUPPORTED_BITS` or null) are declared on the
    config fields (``configs.bounded``).

    Args:
        projector_name: ``"svd"`` or ``"oja"``.
        oja_bits: Tracker bits or ``None``.

    Returns:
        ``"field: message"`` strings.
    """
    if oja_bits is not None and projector_name != "oja":
        return [f"oja_bits: got {oja_bits} with projector {projector_name!r}; set projector: oja "
                "(the streaming tracker) or remove oja_bits"]
    return []


__all__ = ["SUPPORTED_BITS", "principal_angles", "projector_problems", "stochastic_round", "track"]
