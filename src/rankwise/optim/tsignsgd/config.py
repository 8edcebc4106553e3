"""Settings of ``t-signsgd``; the only defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rankwise.configs import bounded
from rankwise.optim.common import betas_problems


@dataclass
class TSignSGDConfig:
    """Ternary signed gradient descent for LoTA-QAF's ternary adapters (arXiv 2505.18724).

    Defaults follow the authors' README recipe (``filter_ratio 0.95``, ``min_grad 0.999``,
    ``filter_upper 0.9999``, ``max_steps 300``) and ``t_signSGD.py`` (the 80/20 phase split,
    the gradient-norm guard of 10 and its 0.99995 quantile).

    Attributes:
        name: Registry name.
        lr: Learning rate of the AdamW group for the trainable parameters that are not ternary
            (a task head); ternary tensors move by exactly one grid step and have no rate.
        weight_decay: Decoupled weight decay of that AdamW group.
        betas: Its Adam betas.
        eps: Its Adam epsilon.
        total_steps: Length of the threshold schedule; ``null`` (the default) takes
            ``train.steps`` when the run config is read.
        start_quantile: The update threshold's quantile of ``|g|`` at the first step.
        mid_quantile: ...at ``phase_split`` of the steps (linear in between).
        end_quantile: ...at the last step (linear from ``mid_quantile``).
        phase_split: Fraction of the steps in the first (coarse) phase.
        spike_norm: In the second phase, when the ternary gradients' global norm exceeds this,
            entries above ``spike_quantile`` of ``|g|`` are also skipped.
        spike_quantile: See ``spike_norm``.
    """

    name: str = "t-signsgd"
    lr: float = bounded(1e-3, gt=0, hint="such as 1e-3")
    weight_decay: float = bounded(0.0, ge=0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-8, ge=0)
    total_steps: Optional[int] = bounded(None, ge=1, hint="(train.steps)")
    start_quantile: float = bounded(0.95, ge=0, lt=1, what="a quantile", hint="such as 0.999")
    mid_quantile: float = bounded(0.999, ge=0, lt=1, what="a quantile", hint="such as 0.999")
    end_quantile: float = bounded(0.9999, ge=0, lt=1, what="a quantile", hint="such as 0.999")
    phase_split: float = bounded(0.8, gt=0, le=1, what="a fraction", hint="such as 0.8")
    spike_norm: float = 10.0
    spike_quantile: float = bounded(0.99995, ge=0, lt=1, what="a quantile", hint="such as 0.999")

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        return betas_problems(self.betas)
