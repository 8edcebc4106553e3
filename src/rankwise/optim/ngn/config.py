"""Settings of ``ngn-m``; the only defaults."""
from __future__ import annotations

from dataclasses import dataclass

from rankwise.optim.common import check_common


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
    lr: float = 1e-2
    weight_decay: float = 0.0
    momentum: float = 0.9

    def problems(self) -> list[str]:
        """Return value errors (empty when valid)."""
        out = check_common(self.lr, self.weight_decay)
        if not 0 <= self.momentum < 1:
            out.append(f"momentum: got {self.momentum}; expected a number in [0, 1) such as 0.9")
        return out
