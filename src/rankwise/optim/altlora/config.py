"""AltLoRA / AltLoRA+ configuration: the one place their defaults live."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from rankwise.configs import bounded
from rankwise.optim.common import betas_problems


@dataclass
class AltLoraConfig:
    """AltLoRA settings ("AltLoRA", alternating projections with low-rank momentum,
    NeurIPS 2025, arXiv 2505.12455).

    Defaults follow ``logtrainer.create_optimizer`` in LucasXinYu/AltLoRA unless marked (ours).

    Attributes:
        name: Registry name (``altlora``; ``altlora-plus`` adds the second moment).
        lr: Step size of the preconditioned steps on A and B. The A-step moves the adapter's
            product by about ``lr * s^2 * P_B G`` (s the LoRA scale, G the full-weight
            gradient), so it behaves like an SGD learning rate, not an Adam one. Default
            (ours): 1.0; on the demo task (MiniLM, gradients clipped to norm 1, 30 steps)
            0.1 / 0.5 / 2 / 5 reached 39 / 74 / 77 / 32 % accuracy.
        betas: (beta1, beta2): momentum, and AltLoRA+'s second-moment decay.
        eps: AltLoRA+'s denominator epsilon (the code uses 1e-4).
        weight_decay: Decoupled decay applied after each step: p -= lr * wd * p.
        reg: lambda in (BᵀB + lambda I)⁻¹ and (A Aᵀ + lambda I)⁻¹.
        mode: ``joint``: every step updates A, then B preconditioned by the new A (the released
            ``main_lora.py``); ``alternate``: ``alternate_every`` steps on A only, then as many
            on B only, starting with A (the paper's alternating scheme).
        alternate_every: Steps per phase in ``alternate`` mode (the code's ``alter_freq``).
        head_lr: Learning rate of the AdamW group for trainable non-LoRA parameters (a task
            head); ``None`` uses ``lr`` (ours).
        head_eps: Adam epsilon of that group (ours).
    """

    name: str = "altlora"
    lr: float = bounded(1.0, gt=0, hint="such as 1e-3")
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-4, gt=0, hint="such as 1e-4")
    weight_decay: float = bounded(1e-5, ge=0)
    reg: float = bounded(1e-5, ge=0, hint="(lambda of (BᵀB + lambda I)⁻¹)")
    mode: Literal["joint", "alternate"] = "joint"
    alternate_every: int = bounded(10, ge=1)
    head_lr: Optional[float] = bounded(None, gt=0)
    head_eps: float = 1e-8

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        return betas_problems(self.betas)


@dataclass
class AltLoraPlusConfig(AltLoraConfig):
    """AltLoRA+ (the paper's Algorithm 2): AltLoRA with an Adam-style second moment on the
    preconditioned gradient. Same fields as :class:`AltLoraConfig`.

    Attributes:
        name: Registry name (``altlora-plus``).
        lr: Dividing by sqrt(V) makes this an Adam-like step size. Default (ours): 5e-4; on the
            demo task (30 steps) 1e-4 / 5e-4 / 2e-3 reached 32 / 75 / 32 % accuracy.
    """

    name: str = "altlora-plus"
    lr: float = bounded(5e-4, gt=0, hint="such as 1e-3")
