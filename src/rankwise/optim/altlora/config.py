"""AltLoRA / AltLoRA+ configuration: the one place their defaults live."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from rankwise.optim.common import check_common


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
    lr: float = 1.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-4
    weight_decay: float = 1e-5
    reg: float = 1e-5
    mode: Literal["joint", "alternate"] = "joint"
    alternate_every: int = 10
    head_lr: Optional[float] = None
    head_eps: float = 1e-8

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        out = check_common(self.lr, self.weight_decay, self.betas)
        if not self.eps > 0:
            out.append(f"eps: got {self.eps}; expected a positive number such as 1e-4")
        if self.reg < 0:
            out.append(f"reg: got {self.reg}; expected a number >= 0 (lambda of (BᵀB + lambda I)⁻¹)")
        if self.alternate_every < 1:
            out.append(f"alternate_every: got {self.alternate_every}; expected an integer >= 1")
        if self.head_lr is not None and self.head_lr <= 0:
            out.append(f"head_lr: got {self.head_lr}; expected a positive number or null")
        return out


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
    lr: float = 5e-4
