"""Mixtures of LoRA experts behind a router: the layer, gates, model glue, and method ``moe-lora``.

FedLEASE builds its client models from the same layer (:func:`factorized_to_mixture` with its
slot layout); ``moe-lora`` (docs/adapters-mixture-prompt.md) injects fresh mixtures into the
target layers.
"""
from __future__ import annotations

from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import adapt
from rankwise.adapters.mixture.config import MoeLoraConfig
from rankwise.adapters.mixture.gates import ThresholdGate, TopKGate, own_expert_slots
from rankwise.adapters.mixture.layer import Gate, LoraExpert, LoraMixture, MixtureLoraLayer
from rankwise.adapters.mixture.model import factorized_to_mixture
from rankwise.core.token_mask import track_token_mask

__all__ = ["Gate", "LoraExpert", "LoraMixture", "MixtureLoraLayer", "TopKGate", "ThresholdGate",
           "own_expert_slots", "factorized_to_mixture",
           "MoeLoraConfig", "apply_moe_lora"]


def make_gate(config: MoeLoraConfig) -> nn.Module:
    """The gate ``config`` asks for: fixed top-k, or top-p routing by cumulative mass."""
    if config.mass_threshold > 0:
        return ThresholdGate(config.mass_threshold, config.top_k)
    return TopKGate(list(range(config.num_experts)), config.top_k)


def apply_moe_lora(model: nn.Module, config: MoeLoraConfig, adapter_name: str = "default"
                   ) -> dict[str, MixtureLoraLayer]:
    """Inject mixture ``adapter_name`` into every target layer and make only it train.

    Args:
        model: Any module with linear layers.
        config: The settings (expert count, top-k or threshold, rank, balance weight).
        adapter_name: Name of the mixture.

    Returns:
        ``{path: MixtureLoraLayer}``.

    Raises:
        RankwiseError: On targets matching nothing or a rank outside [1, min(in, out)].
    """

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, MixtureLoraLayer) else MixtureLoraLayer(module)
        layer.add(adapter_name, config.num_experts, config.r, config.alpha, make_gate(config),
                  dropout=config.dropout, use_rslora=config.use_rslora,
                  router_init=config.router_init, balance_weight=config.balance_weight,
                  entropy_weight=config.entropy_weight if config.mass_threshold > 0 else 0.0)
        return layer

    layers = adapt(model, config, adapter_name, wrap)
    track_token_mask(model)  # padding stays out of the balance loss and the load
    return layers


registry.register("method", "moe-lora", MoeLoraConfig, apply_moe_lora,
                  summary="mixture of LoRA experts, token router, top-k / top-p routing (A7)")
