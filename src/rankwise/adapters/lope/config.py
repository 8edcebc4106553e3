"""LoPE configuration: the one place its defaults live."""
from __future__ import annotations

from dataclasses import dataclass

from rankwise.adapters.common.config import LoraPairConfig


@dataclass
class LopeConfig(LoraPairConfig):
    """Asymmetric LoRA with a poisoning expert (LoPE, arXiv 2505.23868; ROADMAP A6).

    Per target layer: one shared ``A (r, in)``, ``num_experts`` normal ``B_i (out, r)``, one
    poisoning ``B_p (out, r)`` and a router over the ``num_experts + 1`` B experts. Trainable
    parameters per layer: ``r * in + (num_experts + 1) * (r * out + in)``.

    A suitable AdamW learning rate is LoRA's range, 1e-3 to 5e-3 on the demo task.

    Attributes:
        name: Registry name (``lope``).
        r: Rank of the shared A.
        num_experts: Normal B experts (>= 1); the poisoning expert comes on top.
        alpha: Scale numerator (s = alpha / r, or alpha / sqrt(r) with ``use_rslora``).
        noise_std: Noise injected into the poisoning expert's input in training forwards, as a
            multiple of each token's RMS (0 turns injection off; the expert is still masked).
        targets: ``"all-linear"``, a regex over module paths, or a list of name suffixes.
        exclude: Name suffixes never adapted.
        dropout: Dropout on the adapter input.
        use_rslora: s = alpha / sqrt(r).
        modules_to_save: Whole modules trained with the adapter (``None``: the task head).
    """

    name: str = "lope"
    num_experts: int = 3
    noise_std: float = 1.0

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        out = super().problems()
        if self.num_experts < 1:
            out.append(f"num_experts: got {self.num_experts}; expected an integer >= 1 (normal "
                       "experts; the poisoning expert is added on top)")
        if self.noise_std < 0:
            out.append(f"noise_std: got {self.noise_std}; expected a number >= 0")
        return out
