"""LoRA configuration: the one place its defaults live."""
from __future__ import annotations

from dataclasses import dataclass, field

from rankwise.adapters.common.config import LoraPairConfig


@dataclass
class LoraConfig(LoraPairConfig):
    """LoRA / rsLoRA settings (Hu et al. 2021; Kalajdzievski 2023 for rsLoRA).

    Attributes:
        name: Registry name (``lora``).
        r: Rank of every adapted layer unless ``rank_pattern`` says otherwise.
        alpha: Scale numerator: s = alpha / r (or alpha / sqrt(r) with ``use_rslora``).
        targets: ``"all-linear"``, a regex over full module paths, or a list of name suffixes.
        exclude: Name suffixes never adapted.
        dropout: Dropout on the adapter input.
        use_rslora: Use s = alpha / sqrt(r).
        init: Initialisation of A and B: ``kaiming`` (PEFT's default: A Kaiming-uniform,
            B = 0), ``gaussian`` (A ~ N(0, 1/r^2), B = 0). Other methods add their own.
        use_dora: DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation",
            eq. 5): each adapted layer also learns a magnitude per output row, and its weight
            becomes ``m ⊙ (W + s B A) / ||W + s B A||_row`` (norm detached, paper §4.3).
        rank_pattern: ``{regex: r}``; a key matches a module path ``(.*\\.)?(key)$`` as in PEFT.
        alpha_pattern: ``{regex: alpha}``, same matching.
        target_parameters: Fused 3-D expert parameters (``mlp.experts.gate_up_proj``), each
            adapted by a pair per expert (``docs/moe-experts.md``); patterns match the
            parameter's full name. Set ``targets: []`` to adapt only these.
        modules_to_save: Whole modules trained and saved with the adapter. ``None`` means
            the task's head for classification models (``classifier``/``score``), else none.
    """

    parameter_targets = True  # builds ExpertLoraLayer at target_parameters

    name: str = "lora"
    init: str = "kaiming"
    use_dora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        out = super().problems()
        from rankwise.adapters.common.factors import LORA_INITS
        if self.init not in LORA_INITS:
            out.append(f"init: got {self.init!r}; expected one of {sorted(LORA_INITS)}")
        from rankwise.adapters.common.experts import EXPERT_INITS
        if self.target_parameters and self.init in LORA_INITS and self.init not in EXPERT_INITS:
            out.append(f"init: {self.init!r} is not available with target_parameters; expected "
                       f"one of {list(EXPERT_INITS)}")
        if self.target_parameters and self.use_dora:  # PEFT refuses it too
            out.append("use_dora: not available with target_parameters (expert pairs are plain "
                       "LoRA); drop one of them")
        return out
