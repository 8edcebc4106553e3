"""Truncated SVD, plain or activation-aware (whitened), stored as two factors."""
from __future__ import annotations

import torch

from rankwise.compress.base import Compressed, Compressor, damped


def energy_rank(singular: torch.Tensor, energy: float) -> int:
    """Smallest ``r`` with ``Σ_{i<r} σ_i² ≥ energy · Σ σ_i²`` (at least 1)."""
    power = singular.double() ** 2
    total = float(power.sum())
    if total <= 0:
        return 1
    cum = torch.cumsum(power, 0) / total
    return int(min(int((cum < energy - 1e-12).sum()) + 1, singular.numel()))


def lowrank_tensors(left: torch.Tensor, right: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stored factors ``{"L" (out, r), "R" (r, in)}``."""
    return {"L": left.to(dtype).contiguous(), "R": right.to(dtype).contiguous()}


def decode_lowrank(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """``L @ R`` in float32."""
    return tensors["L"].float() @ tensors["R"].float()


class TruncatedSVD(Compressor):
    """Truncated SVD ``W ≈ U_r Σ_r V_rᵀ`` (Eckart–Young), the classic low-rank baseline; with
    ``whiten`` the activation-aware variant of SVD-LLM (Wang et al., "SVD-LLM: Truncation-aware
    Singular Value Decomposition for LLM Compression", ICLR 2025, Eq. 5-6): with
    ``H = C Cᵀ`` (Cholesky), truncate ``W C`` and map back with ``C⁻¹``, which minimises
    ``‖(W − Ŵ)X‖_F`` over rank-r ``Ŵ``. Factors: ``L = U_r Σ_r^{1/2}``,
    ``R = Σ_r^{1/2} V_rᵀ (C⁻¹)``.

    With ``energy``, the rank is chosen on the spectrum that is truncated (whitened or not).
    """

    @property
    def needs_hessian(self) -> bool:  # type: ignore[override]
        """Only the whitened variant uses calibration data."""
        return bool(self.config.whiten)

    def compress(self, weight, hessian):
        """Factor the (whitened) weight and keep the top singular triplets."""
        c = self.config
        w = weight.double()
        chol = torch.linalg.cholesky(damped(hessian, c.damp)) if c.whiten else None
        target = w @ chol if c.whiten else w
        u, s, vh = torch.linalg.svd(target, full_matrices=False)
        r = c.rank if c.rank is not None else energy_rank(s, c.energy)
        root = torch.sqrt(s[:r])
        left, right = u[:, :r] * root, root[:, None] * vh[:r]
        if c.whiten:
            # right · C⁻¹ without forming the inverse: solve Cᵀ xᵀ = rightᵀ
            right = torch.linalg.solve_triangular(chol.T, right.T, upper=True).T
        tensors = lowrank_tensors(left, right, self.value_dtype)
        energy = float((s[:r] ** 2).sum() / (s ** 2).sum().clamp(min=1e-30))
        return Compressed(tensors, decode_lowrank(tensors), r * sum(weight.shape),
                          {"rank": r, "energy_kept": energy})

    def decode(self, tensors, shape):
        """``L @ R``."""
        return decode_lowrank(tensors)
