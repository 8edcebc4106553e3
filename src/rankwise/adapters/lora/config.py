"""LoRA configuration: the one place its defaults live."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rankwise.adapters.common.config import LoraPairConfig
from rankwise.configs import bounded


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
        init: Initialisation of A and B (docs/lora-inits.md): ``kaiming`` (PEFT's default: A
            Kaiming-uniform, B = 0), ``gaussian`` (A ~ N(0, 1/r^2), B = 0), ``pissa`` /
            ``pissa_niter_N`` (top-r SVD of W, exact or randomised with N iterations),
            ``olora`` (QR of W), ``loftq`` (4-bit base: SVD of the quantization residual),
            ``eva`` (SVD of the layers' inputs over calibration batches, ranks redistributed),
            ``corda`` (SVD of W C, C the calibration input covariance). PiSSA, OLoRA and CorDA
            keep ``W`` as loaded and subtract their frozen initial ``s B0 A0`` (the residual
            base); the saved adapter holds ``A0, B0``.
        loftq_iter: LoftQ's alternations of quantizing and SVD (1: the base stays the NF4 of W
            that was loaded; more re-quantize the base, see docs/lora-inits.md).
        eva_rho: EVA's cap on a layer's rank after redistribution, ``round(rho * r)`` (1: no
            redistribution).
        corda_mode: CorDA's mode: ``ipm`` (instruction-previewed: the top-r components of
            ``W C`` train; the calibration data are the task's) or ``kpm`` (knowledge-preserved:
            the r smallest train, the principal ones stay frozen).
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
    loftq_iter: int = bounded(1, ge=1)
    eva_rho: float = bounded(2.0, ge=1, what="a number", hint="(1: no redistribution)")
    corda_mode: Literal["ipm", "kpm"] = "ipm"

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        out = super().problems()
        from rankwise.adapters.lora.inits import NAMED_INITS, init_kind
        if not init_kind(self.init):
            out.append(f"init: got {self.init!r}; expected one of {', '.join(NAMED_INITS)} "
                       "(N >= 1 subspace iterations, e.g. pissa_niter_4)")
        if self.use_dora and init_kind(self.init) in ("pissa", "olora", "corda", "loftq"):
            out.append(f"init: {self.init} with use_dora is not supported (DoRA's magnitude and "
                       "row norm would not see the part of W the init moved); use kaiming, "
                       "gaussian or eva with DoRA, or drop use_dora")
        from rankwise.adapters.common.experts import EXPERT_INITS
        if self.target_parameters and init_kind(self.init) and self.init not in EXPERT_INITS:
            out.append(f"init: {self.init!r} is not available with target_parameters; expected "
                       f"one of {list(EXPERT_INITS)}")
        if self.target_parameters and self.use_dora:  # PEFT refuses it too
            out.append("use_dora: not available with target_parameters (expert pairs are plain "
                       "LoRA); drop one of them")
        return out
