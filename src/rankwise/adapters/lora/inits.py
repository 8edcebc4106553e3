"""LoRA initialisations from the weight or from calibration data (``method.init``).

The functions here are plain linear algebra on float32 tensors in the ``(out, in)`` layout;
the factor makers return ``A (r, in)``, ``B (out, r)`` and ``initialise.py`` puts them in place.
With ``s = alpha / r`` (or rsLoRA's) the adapter adds ``s B A``, so the SVD-based inits divide
the singular values they hand out by ``s`` and ``s B A`` is the part of ``W`` they stand for
(OLoRA keeps PEFT's unscaled ``Q_r``, ``R_r``).

* PiSSA (Meng et al. 2024, eq. 2-4): ``W = U S V^T``; ``A = sqrt(S_r / s) V_r^T``,
  ``B = U_r sqrt(S_r / s)``, residual base ``W - s B A`` (the other singular triplets).
  ``pissa_niter_N`` takes ``U_r, S_r, V_r`` from Halko et al.'s randomised SVD with N subspace
  iterations (``torch.svd_lowrank``, Meng et al. §3 "fast SVD").
* OLoRA (Büyükakyüz 2024, Alg. 1): ``W = Q R``; ``B = Q_r``, ``A = R_r`` (the first r columns /
  rows, not divided by s), residual base ``W - s B A``.
* LoftQ (Li et al. 2023, Alg. 1): ``Q_t = NF4(W - s B_{t-1} A_{t-1})`` and
  ``B_t, A_t = SVD_r(W - Q_t)`` (split as ``U sqrt(S/s)``, ``sqrt(S/s) V^T``), from ``A_0 B_0 = 0``.
* EVA (Paischer et al. 2024, §3.1-3.2): ``A``'s rows are the top right-singular vectors of the
  (centred) layer inputs ``X``, i.e. the top eigenvectors of their covariance; ``B = 0``. Ranks
  are redistributed over layers by explained variance (:func:`eva_ranks`).
* CorDA (Yang et al. 2024, eq. 3-5): with ``C = X^T X / n`` the input covariance,
  ``W C = U S V^T`` and ``W = U S (V^T C^{-1})``; the instruction-previewed mode (IPM, the one
  used here: the calibration data are the task's own) puts the top r triplets in the adapter,
  ``A = sqrt(S_r / s) V_r^T C^{-1}``, ``B = U_r sqrt(S_r / s)``, residual base ``W - s B A``.
  The knowledge-preserved mode (KPM) takes the r smallest instead (``corda_mode: kpm``).
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from rankwise.errors import RankwiseError

# inits that keep the base and only set A, B (the two random ones live in common.factors)
RESIDUAL_INITS = ("pissa", "olora", "corda")       # move part of W into the adapter (A0, B0)
DATA_INITS = ("eva", "corda")                        # need calibration batches
NAMED_INITS = ("kaiming", "gaussian", "pissa", "pissa_niter_N", "olora", "loftq", "eva", "corda")
_NITER = re.compile(r"pissa_niter_([1-9][0-9]*)")


def init_kind(init: str) -> str:
    """The family of init name ``init`` (``pissa_niter_4`` -> ``pissa``); ``""`` if unknown."""
    if _NITER.fullmatch(init):
        return "pissa"
    return init if init in NAMED_INITS and init != "pissa_niter_N" else ""


def pissa_niter(init: str) -> int | None:
    """N of ``pissa_niter_N``, or ``None`` for the exact SVD."""
    m = _NITER.fullmatch(init)
    return int(m[1]) if m else None


def _split(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, scale: float):
    """``A = sqrt(s / scale) vh``, ``B = u sqrt(s / scale)`` so that ``scale B A = u diag(s) vh``."""
    root = (s / scale).sqrt()
    return root[:, None] * vh, u * root[None, :]


def pissa(w: torch.Tensor, r: int, scale: float, niter: int | None = None):
    """PiSSA's factors of ``w (out, in)``: the top-r singular triplets (Meng et al. 2024, eq. 2-4).

    Args:
        w: The float32 weight.
        r: Rank.
        scale: The adapter scale s.
        niter: Subspace iterations of the randomised SVD; ``None``: exact SVD.

    Returns:
        ``(A (r, in), B (out, r))`` with ``s B A`` the best rank-r approximation of ``w``.
    """
    if niter is None:
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        u, s, vh = u[:, :r], s[:r], vh[:r]
    else:
        u, s, v = torch.svd_lowrank(w, q=r, niter=niter)  # seeded by the caller's RNG
        vh = v.T
    return _split(u, s, vh, scale)


def olora(w: torch.Tensor, r: int):
    """OLoRA's factors (Büyükakyüz 2024, Alg. 1): ``w = Q R``, ``B = Q_r`` (orthonormal),
    ``A = R_r``; the residual base is ``w - s B A``. As in the paper and PEFT the factors are
    not divided by ``s``: ``B`` keeps orthonormal columns whatever alpha is.

    Returns:
        ``(A (r, in), B (out, r))``.
    """
    q, rr = torch.linalg.qr(w)
    return rr[:r].contiguous(), q[:, :r].contiguous()


def nf4_roundtrip(w: torch.Tensor, blocksize: int = 64) -> torch.Tensor:
    """``dequantize(quantize_nf4(w))`` with bitsandbytes, in float32 (blocks of ``blocksize``,
    no double quantization: the grid QLoRA and PEFT's LoftQ use)."""
    import bitsandbytes.functional as bnbf
    packed, state = bnbf.quantize_4bit(w.float().contiguous(), blocksize=blocksize, quant_type="nf4")
    return bnbf.dequantize_4bit(packed, state).float()


def loftq(w: torch.Tensor, r: int, scale: float, iters: int,
          quantize: Callable[[torch.Tensor], torch.Tensor] = nf4_roundtrip):
    """LoftQ (Li et al. 2023, Alg. 1): alternate ``Q = quantize(w - s B A)`` and
    ``(A, B) = SVD_r(w - Q)``, ``iters`` times from ``B A = 0``.

    Args:
        w: The full-precision float32 weight.
        r: Rank.
        scale: The adapter scale s.
        iters: Alternations T >= 1 (T = 1: ``Q = quantize(w)``, the base QLoRA loads).
        quantize: Dequantized quantization of a matrix.

    Returns:
        ``(A, B, Q, A_prev, B_prev)``: the factors, the dequantized base they pair with, and
        the factors ``Q`` was quantized against (zeros when ``iters == 1``), from which
        ``Q = quantize(w - s B_prev A_prev)`` is rebuilt exactly.
    """
    a_prev = w.new_zeros(r, w.shape[1])
    b_prev = w.new_zeros(w.shape[0], r)
    a = b = q = None
    for t in range(iters):
        if t:
            a_prev, b_prev = a, b
        q = quantize(w - scale * b_prev @ a_prev)
        u, s, vh = torch.linalg.svd(w - q, full_matrices=False)
        a, b = _split(u[:, :r], s[:r], vh[:r], scale)
    return a, b, q, a_prev, b_prev


def damped_inverse(cov: torch.Tensor):
    """``(C + d I, (C + d I)^{-1})`` with ``d = damp * mean(diag C)``, ``damp`` from 0.01
    doubling until ``||(C + d I) (C + d I)^{-1} - I||_F < 0.05`` (CorDA's rule for a covariance
    that is rank-deficient on few calibration tokens)."""
    eye = torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device)
    mean_diag = cov.diagonal().mean()
    damp = 0.01
    for _ in range(60):
        fixed = cov + damp * mean_diag * eye
        inv = torch.linalg.inv(fixed)
        if torch.dist(fixed @ inv, eye) < 0.05:
            return fixed, inv
        damp *= 2
    raise RankwiseError("CorDA: the calibration covariance of a layer cannot be inverted; use more "
                        "train.calibration_batches")


def corda(w: torch.Tensor, cov: torch.Tensor, r: int, scale: float, mode: str = "ipm"):
    """CorDA's factors (Yang et al. 2024, eq. 3-5): SVD of ``w C`` with ``C`` the damped input
    covariance, ``A = sqrt(S_r / s) V_r^T C^{-1}``, ``B = U_r sqrt(S_r / s)``.

    Args:
        w: The float32 weight ``(out, in)``.
        cov: The input covariance ``(in, in)``.
        r: Rank.
        scale: The adapter scale s.
        mode: ``ipm`` (the top r triplets) or ``kpm`` (the r smallest).

    Returns:
        ``(A (r, in), B (out, r))``.
    """
    fixed, inv = damped_inverse(cov)
    u, s, vh = torch.linalg.svd(w @ fixed, full_matrices=False)
    keep = slice(0, r) if mode == "ipm" else slice(s.shape[0] - r, s.shape[0])
    return _split(u[:, keep], s[keep], vh[keep] @ inv, scale)


def eva_components(cov: torch.Tensor, mean: torch.Tensor, count: int, r: int):
    """EVA's candidates of one layer: the top ``r`` principal directions of its inputs.

    Args:
        cov: ``sum x x^T`` over the ``count`` input vectors ``(in, in)``.
        mean: Their mean ``(in,)``.
        count: How many input vectors.
        r: How many components to return (the layer's maximal rank).

    Returns:
        ``(V (r, in), ratio (r,))``: right-singular vectors of the centred inputs, largest
        first, and the share of the total variance each explains.
    """
    centred = cov / count - torch.outer(mean, mean)          # (in, in)
    values, vectors = torch.linalg.eigh(centred)              # ascending
    values = values.flip(0).clamp_min(0)
    vectors = vectors.flip(1)
    return vectors[:, :r].T.contiguous(), values[:r] / values.sum().clamp_min(1e-30)


def eva_ranks(ratios: dict[str, torch.Tensor], budget: int) -> dict[str, int]:
    """EVA's rank redistribution (Paischer et al. 2024, §3.2): sort every layer's explained
    variance ratios together and give each layer as many components as it has among the top
    ``budget`` (``r`` times the number of layers); layers may get 0.

    Returns:
        ``{path: rank}`` summing to ``budget`` (or to every candidate, if fewer).
    """
    pool = sorted(((float(v), path, i) for path, vals in ratios.items() for i, v in enumerate(vals)),
                  key=lambda t: (-t[0], t[1], t[2]))
    out = {path: 0 for path in ratios}
    for _, path, _ in pool[:budget]:
        out[path] += 1
    return out
