"""Config of GLVQ: grouped lattice vector quantization with learned generators."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union, get_args

from rankwise.compress.config import CompressConfig, Quantization
from rankwise.configs import bounded

BITS = (1, 2, 3, 4)
Allocation = Literal["salience", "uniform"]
ALLOCATIONS = get_args(Allocation)


@dataclass
class GLVQConfig(Quantization, CompressConfig):
    """GLVQ.

    Attributes:
        bits: Bits per weight (1-4): every lattice coordinate is a ``bits``-bit integer.
        group_size: Input columns per group.
        group_rows: Output rows per group (``null``: all rows, the paper's large groups).
        dim: Lattice dimension ``d``: ``d`` consecutive weights of a row form one vector, and
            each group has its own ``d × d`` generator.
        rounds: Alternations of Babai rounding and generator updates.
        steps: Adam steps on the generators and companding parameters per round.
        lr: Adam learning rate, relative to the generator's initial scale.
        companding: Learn a per-group μ-law companding before the lattice (μ in [10, 255]).
        allocation: ``salience``: mix ``bits − 1``, ``bits`` and ``bits + 1`` across groups by
            SliM-LLM's Hessian salience at an average of exactly ``bits`` (the paper's low-bit
            setting; 2 and 3 bits only, 1 and 4 stay uniform); ``uniform``: every group ``bits``.
        regularization: ``λ`` of the pull towards the initial generator,
            ``λ · err_g⁽⁰⁾ · ‖G_g − G_g⁽⁰⁾‖² / ‖G_g⁽⁰⁾‖²`` (0 turns it off).
    """

    bits: int = 4
    group_size: int = bounded(128, ge=1, hint="such as 128")
    group_rows: Union[int, None] = bounded(None, ge=1)
    dim: int = bounded(8, ge=1)
    rounds: int = bounded(6, ge=1)
    steps: int = bounded(10, ge=0)
    lr: float = bounded(0.02, gt=0)
    companding: bool = True
    allocation: Allocation = "salience"
    regularization: float = bounded(0.1, ge=0)

    def problems(self) -> list[str]:
        """Return value errors."""
        out = CompressConfig.problems(self) + self.quant_problems(BITS)
        if self.dim >= 1 and self.group_size >= 1 and self.group_size % self.dim:
            out.append(f"group_size: got {self.group_size}; expected a multiple of dim={self.dim}")
        return out

    def layer_problems(self, path: str, shape: tuple[int, int]) -> list[str]:
        """Groups must tile the layer."""
        out = []
        if shape[1] % self.group_size:
            out.append(f"group_size: {path} has {shape[1]} inputs, not a multiple of "
                       f"{self.group_size}; choose a group_size that divides it")
        if self.group_rows is not None and shape[0] % self.group_rows:
            out.append(f"group_rows: {path} has {shape[0]} outputs, not a multiple of "
                       f"{self.group_rows}; choose group_rows that divides it (or null)")
        return out
