"""Settings of ``ngn-m``; the only defaults."""
from __future__ import annotations

from dataclasses import dataclass

from rankwise.configs import bounded


@dataclass
class NGNMConfig:
    """NGN-M: the NGN step size with heavy-ball momentum (Islamov et al. 2025).

    Attributes:
        name: Registry name.
        lr: ``c``, the step-size hyperparameter (the largest step NGN may take).
        weight_decay: Decoupled weight decay, scaled by the adaptive step ``gamma``.
        momentum: ``beta``, heavy-ball momentum in ``[0, 1)`` (0 gives plain NGN).
    """

    name: str = "ngn-m"
    lr: float = bounded(1e-2, gt=0, hint="such as 1e-3")
    weight_decay: float = bounded(0.0, ge=0)
    momentum: float = bounded(0.9, ge=0, lt=1, hint="such as 0.9")
