"""LoPE (ROADMAP A6): config, layer, and the registration."""
from __future__ import annotations

from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import adapt, rebuild_at_paths
from rankwise.adapters.lope.config import LopeConfig
from rankwise.adapters.lope.layer import LopeLayer, PoisonedExperts

__all__ = ["LopeConfig", "LopeLayer", "PoisonedExperts", "apply_lope"]


def apply_lope(model: nn.Module, config: LopeConfig, adapter_name: str = "default"
               ) -> dict[str, LopeLayer]:
    """Inject LoPE adapter ``adapter_name`` into every target layer; only it (and the task
    head) trains.

    Args:
        model: Any module with linear layers.
        config: Rank, expert count, noise level.
        adapter_name: Name of the adapter.

    Returns:
        ``{path: LopeLayer}``.

    Raises:
        RankwiseError: If the targets match nothing or the rank does not fit a layer.
    """

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, LopeLayer) else LopeLayer(module)
        layer.add(adapter_name, config.r, config.num_experts, config.alpha, config.noise_std,
                  config.dropout, config.use_rslora)
        return layer

    return adapt(model, config, adapter_name, wrap)


registry.register("method", "lope", LopeConfig, apply_lope, rebuild=rebuild_at_paths(apply_lope),
                  summary="LoPE: shared-A LoRA experts + a poisoning expert masked at inference (A6)")
