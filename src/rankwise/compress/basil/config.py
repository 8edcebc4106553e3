"""Config of 3BASiL(-TM): sparse + low-rank by 3-block ADMM, then transformer matching."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from rankwise.compress.config import CompressConfig, Sparsity


@dataclass
class BasilConfig(Sparsity, CompressConfig):
    """3BASiL-TM.

    Attributes:
        pattern: ``"N:M"`` of the sparse part (default 2:4); ``null`` uses ``sparsity``
            (unstructured, one magnitude budget over the whole layer).
        rank: Rank of the low-rank part ``L·R`` in every layer.
        iterations: Most ADMM iterations per layer (it stops earlier once the support is stable).
        min_iterations: ADMM iterations before the support test may stop it.
        rho: Initial ADMM penalty ρ (raised while the support keeps changing).
        check_every: Iterations between support checks / ρ updates / objective records.
        damp: ``H += damp · mean(diag H) · I``.
        diag_damp: ``H += diag_damp · diag(H)``.
        tm_epochs: Transformer-matching epochs per block (0 = off: plain 3BASiL).
        tm_lr: Adam learning rate of transformer matching (cosine-decayed to ``tm_lr / 5``).
        tm_batch: Calibration batches per transformer-matching step.
    """

    pattern: Union[str, None] = "2:4"
    rank: int = 8
    iterations: int = 80
    min_iterations: int = 40
    rho: float = 0.3
    check_every: int = 10
    damp: float = 0.005
    diag_damp: float = 0.005
    tm_epochs: int = 4
    tm_lr: float = 1e-4
    tm_batch: int = 1

    def problems(self) -> list[str]:
        """Return value errors."""
        out = CompressConfig.problems(self) + self.sparsity_problems()
        for name in ("rank", "iterations", "check_every", "tm_batch"):
            if getattr(self, name) < 1:
                out.append(f"{name}: got {getattr(self, name)}; expected an integer >= 1")
        for name in ("min_iterations", "tm_epochs"):
            if getattr(self, name) < 0:
                out.append(f"{name}: got {getattr(self, name)}; expected an integer >= 0")
        for name in ("rho", "tm_lr"):
            if getattr(self, name) <= 0:
                out.append(f"{name}: got {getattr(self, name)}; expected a positive number")
        for name in ("damp", "diag_damp"):
            if getattr(self, name) < 0:
                out.append(f"{name}: got {getattr(self, name)}; expected a number >= 0")
        return out

    def layer_problems(self, path: str, shape: tuple[int, int]) -> list[str]:
        """The rank must fit the layer; an N:M pattern must tile its inputs."""
        out = self.pattern_layer_problems(path, shape)
        if self.rank > min(shape):
            out.append(f"rank: {self.rank} is larger than layer {path} {tuple(shape)} allows "
                       f"({min(shape)}); lower compress.rank")
        return out
