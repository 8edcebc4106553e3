"""``moe-lora`` configuration: the one place its defaults live."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rankwise.adapters.common.config import LoraPairConfig
from rankwise.configs import bounded


@dataclass
class MoeLoraConfig(LoraPairConfig):
    """Mixture of LoRA experts with a token-level router (MixLoRA-style top-k, top-p routing of
    Huang et al. 2024; docs/adapters-mixture-prompt.md).

    Every target linear layer gets ``num_experts`` LoRA experts of rank ``r`` and a router
    (``nn.Linear(in, num_experts)``). A token uses its ``top_k`` most probable experts, or,
    with ``mass_threshold > 0``, top-p routing (Huang et al. 2024, "Harder Tasks Need More
    Experts: Dynamic Routing in MoE Models"): the fewest experts whose router probabilities
    reach the threshold, at most ``top_k``, with the paper's dynamic loss (router entropy,
    ``entropy_weight``). This is not FedLEASE's adaptive top-M, which is top-k over ``2M-1``
    router slots (``rankwise.federated.moe``). Trainable parameters per layer:
    ``num_experts * r * (in + out) + num_experts * in``; ``num_experts * r`` equal to LoRA's rank
    matches LoRA's budget up to the routers.

    A suitable AdamW learning rate is LoRA's range, 1e-3 to 5e-3 on the demo task (the experts
    are LoRA pairs; the router trains at the same rate).

    Attributes:
        name: Registry name (``moe-lora``).
        num_experts: Experts per layer (>= 1).
        top_k: Experts per token (fixed routing), or the cap of top-p routing.
        mass_threshold: 0 = fixed top-k; a value in (0, 1] = top-p routing with p = this
            (Huang et al. use 0.4).
        r: Rank of every expert.
        alpha: Scale numerator (s = alpha / r, or alpha / sqrt(r) with ``use_rslora``).
        targets: ``"all-linear"``, a regex over module paths, or a list of name suffixes.
        exclude: Name suffixes never adapted.
        dropout: Dropout on the experts' input.
        use_rslora: s = alpha / sqrt(r).
        balance_weight: Coefficient of the switch load-balancing loss (Switch Transformer's
            0.01); 0 turns it off.
        entropy_weight: Coefficient of top-p routing's dynamic loss, the mean router entropy
            ``-sum_e P_e log P_e`` (Huang et al. 2024, Sec. 3: without it a threshold router
            learns flat distributions that activate every expert). Used only with
            ``mass_threshold > 0``; 1e-4 is the paper's beta as we recall it (the text we could
            store did not show the number); 0 turns it off.
        router_init: ``kaiming`` (``nn.Linear``'s default: tokens spread from the start) or
            ``zeros`` (uniform probabilities; top-k ties then pick the first experts).
        modules_to_save: Whole modules trained and saved with the adapter (``None``: the
            classification head, as for LoRA).
    """

    name: str = "moe-lora"
    num_experts: int = bounded(4, ge=1)
    top_k: int = bounded(2, ge=1)
    mass_threshold: float = bounded(0.0, ge=0.0, le=1.0, hint="(0: fixed top-k)")
    r: int = bounded(2, ge=1)
    alpha: float = bounded(4.0, gt=0)
    balance_weight: float = bounded(0.01, ge=0)
    entropy_weight: float = bounded(1e-4, ge=0)
    router_init: Literal["kaiming", "zeros"] = "kaiming"

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        out = super().problems()
        if 1 <= self.num_experts < self.top_k:
            out.append(f"top_k: got {self.top_k}, more than num_experts={self.num_experts}; "
                       f"choose top_k <= {self.num_experts}")
        return out
