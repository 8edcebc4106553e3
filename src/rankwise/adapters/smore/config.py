"""S'MoRE configuration: the one place its defaults live."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union, get_args

from rankwise.adapters.common.config import TargetedConfig
from rankwise.configs import bounded

ExpertAct = Literal["tanh", "relu", "identity"]
GateAct = Literal["relu", "tanh", "identity"]
EXPERT_ACTS = get_args(ExpertAct)
GATE_ACTS = get_args(GateAct)


@dataclass
class SmoreConfig(TargetedConfig):
    """Structural Mixture of Residual Experts (Zeng et al., NeurIPS 2025;
    docs/adapters-mixture-prompt.md).

    Per target linear layer, ``L = len(ranks)`` levels of residual experts: level ``l`` has
    ``experts[l]`` experts of rank ``ranks[l]`` and every selected parent picks ``fanout[l]``
    of them. Defaults follow the authors' Llama-3 example (one level of 4 experts, 2 active,
    rank 16, gate width 32, tanh experts, switch gate, ``w_final_zero`` init); multi-level
    configs are lists such as ``experts: [4, 4]``. With ``s_l`` experts the hidden widths are
    ``d_0 = 0, d_{l+1} = d_l + s_l r_l`` and trainable parameters per layer are about
    ``sum_l s_l r_l (in + d_{l+1}) + out d_L + in down_dim`` plus the gates.

    A suitable AdamW learning rate is 1e-4 to 1e-3 for billion-parameter models (the authors
    use 1e-4) and 1e-3 to 5e-3 on the small demo model.

    Attributes:
        name: Registry name (``smore``).
        ranks: ``r_l`` per level (bottom level 0 first).
        experts: ``s_l`` per level (>= 1).
        fanout: ``f_l``: children each selected parent picks at level ``l`` (at the top level:
            experts per token); ``1 <= f_l <= s_l``.
        gate_dims: Width ``d_g`` of each level's gate MLP and expert keys.
        down_dim: Width of the token projection the gates read (``x_bar``, 32 in the paper).
        alpha: Per-level scale numerators (scale ``alpha_l / r_l``); ``None`` = scale 1 (the
            authors' submitted configuration).
        expert_act: Activation sigma applied to every residual (``tanh``, ``relu``, ``identity``).
        gate_act: Activation inside the gate MLP.
        balance_weight: Coefficient of the switch balance loss, summed over levels and layers
            (the authors' 1e-2).
        targets: ``"all-linear"``, a regex over module paths, or a list of name suffixes.
        exclude: Name suffixes never adapted.
        modules_to_save: Whole modules trained with the adapter (``None``: the task head).
    """

    name: str = "smore"
    ranks: list[int] = field(default_factory=lambda: [16])
    experts: list[int] = field(default_factory=lambda: [4])
    fanout: list[int] = field(default_factory=lambda: [2])
    gate_dims: list[int] = field(default_factory=lambda: [32])
    down_dim: int = bounded(32, ge=1)
    alpha: Union[list[float], None] = None
    expert_act: ExpertAct = "tanh"
    gate_act: GateAct = "relu"
    balance_weight: float = bounded(0.01, ge=0)

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        out = super().problems()
        levels = len(self.experts)
        if levels == 0:
            out.append("experts: got []; expected one expert count per level, e.g. [4]")
        for key in ("ranks", "fanout", "gate_dims") + (("alpha",) if self.alpha is not None else ()):
            if len(getattr(self, key)) != levels:
                out.append(f"{key}: got {getattr(self, key)}; expected {levels} value(s), one per "
                           f"level as in experts={self.experts}")
        for key in ("ranks", "experts", "fanout", "gate_dims"):
            bad = [v for v in getattr(self, key) if v < 1]
            if bad:
                out.append(f"{key}: got {getattr(self, key)}; every value must be >= 1")
        for lvl, (f, s) in enumerate(zip(self.fanout, self.experts)):
            if s >= 1 and f > s:
                out.append(f"fanout: level {lvl} picks {f} of {s} experts; choose fanout <= experts")
        return out
