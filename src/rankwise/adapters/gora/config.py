"""GoRA configuration: the one place its defaults live."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from rankwise.adapters.common.config import LoraPairConfig
from rankwise.configs import bounded

IMPORTANCES = ("union_mean", "union_frobenius", "grad_nuclear", "grad_log_sv", "union_log_sv")


@dataclass
class GoraConfig(LoraPairConfig):
    """GoRA settings ("GoRA: Gradient-driven Adaptive Low Rank Adaptation", NeurIPS 2025,
    arXiv 2502.12171).

    Defaults follow the paper's released scripts (``scripts/gora/*.sh`` in hhnqqq/MyTransformers)
    where they exist; ``(ours)`` marks choices of rankwise.

    Attributes:
        name: Registry name (``gora``).
        r: The reference rank r0. The parameter budget is ``sum_W (m_W + n_W) * r``, the same
            number of adapter weights as uniform LoRA at rank ``r`` on the same targets.
        alpha: Scale numerator. With ``use_rslora`` each layer gets s_W = alpha / sqrt(r_W)
            (the scripts' ``--gora-dynamic-scaling --gora-rank-stablize``), else alpha / r_W.
        use_rslora: See ``alpha``.
        targets: As in LoRA: ``"all-linear"``, a regex over module paths, or name suffixes.
        exclude: Name suffixes never adapted.
        dropout: Dropout on the adapter input.
        modules_to_save: Whole modules trained and saved with the adapter; ``None`` = task head.
        r_min: Smallest rank a layer may get; 0 lets unimportant layers be skipped entirely.
            ``None`` (default): r / 2 (rounded down), the paper's 4 at r = 8.
        r_max: Largest rank a layer may get (also capped at min(m, n) per layer). ``None``
            (default): 4 r, the paper's 32 at r = 8. Clamps that leave no room around r (for
            example r_max <= r) make the allocation uniform; the builder then warns.
        importance: Per-layer importance from the averaged gradient G and weight W:
            ``union_mean`` = mean|W ⊙ G| (the paper's scripts), ``union_frobenius`` = ||W ⊙ G||_F
            (the code's default), ``grad_nuclear`` = ||G||_*, ``grad_log_sv`` / ``union_log_sv``
            = sum of log(1 + sigma_i) over the top 4·r singular values of G / of W ⊙ G.
        sqrt_importance: Use sqrt(I) before normalising (``--gora-scale-importance``).
        softmax_temperature: If set, normalise with softmax(((I - min)/(max - min)) / T)
            instead of I / sum(I) (``--gora-softmax-importance``; the code uses T = 0.5).
        allocation: ``largest_remainder`` (ours): water-fill the budget under the clamps, then
            round so the total stays within one layer's (m + n) of the budget;
            ``round``: the code's rule, r_W = clamp(round(b * I_W / (m + n))), which may drift.
        n_batches: Calibration batches whose gradients are averaged (``--gradient-est-n-steps``).
        early_stop: Stop before ``n_batches`` once every layer's importance changed by less
            than ``stop_tolerance`` (relative) from one batch to the next.
        stop_tolerance: See ``early_stop`` (the code's ``--gora-convergence-threshold``).
        min_batches: Never stop before this many batches.
        init_lr: eta_g, the step size of the initial projected gradient step.
        scale_init_by_dim: Multiply ``init_lr`` by sqrt(n_in / r_W) (``--gora-scale-by-lr``),
            so the projected step keeps the size of a full step as the rank shrinks.
        init_sign: ``descent``: s·B A = -eta·G·P_A, one gradient-descent step (the paper, and
            the code until Aug 2025); ``ascent``: +eta·G·P_A (the released code since then).
    """

    name: str = "gora"
    use_rslora: bool = True
    r_min: Optional[int] = bounded(None, ge=0, hint="(null: r / 2)")
    r_max: Optional[int] = None
    importance: Literal["union_mean", "union_frobenius", "grad_nuclear", "grad_log_sv",
                        "union_log_sv"] = "union_mean"
    sqrt_importance: bool = False
    softmax_temperature: Optional[float] = bounded(None, gt=0)
    allocation: Literal["largest_remainder", "round"] = "largest_remainder"
    n_batches: int = bounded(8, ge=1)
    early_stop: bool = False
    stop_tolerance: float = bounded(0.1, gt=0)
    min_batches: int = bounded(3, ge=1)
    init_lr: float = bounded(5e-2, ge=0, hint="(0 gives B = 0)")
    scale_init_by_dim: bool = True
    init_sign: Literal["descent", "ascent"] = "descent"

    @property
    def min_rank(self) -> int:
        """``r_min``, or r // 2 when it is None."""
        return self.r // 2 if self.r_min is None else self.r_min

    @property
    def max_rank(self) -> int:
        """``r_max``, or 4 r when it is None."""
        return 4 * self.r if self.r_max is None else self.r_max

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        out = super().problems()
        if self.max_rank < max(1, self.min_rank):
            out.append(f"r_max: got {self.r_max}; expected an integer >= max(1, r_min={self.min_rank}) "
                       "or null (4 r)")
        return out
