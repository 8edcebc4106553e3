"""LoPE (ROADMAP A6): config, layer, and the registration."""
from __future__ import annotations

from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import rebuild_at_paths
from rankwise.adapters.lope.config import LopeConfig
from rankwise.adapters.lope.layer import LopeLayer, PoisonedExperts
from rankwise.core.inject import default_heads, find_targets, inject
from rankwise.core.ops import mark_trainable, set_modules_to_save
from rankwise.core.quant import keep_training_layout

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
    paths = find_targets(model, config.targets, config.exclude, "method.targets")
    keep_training_layout(model)  # 4-bit bases: no CPU inference repacking while adapted

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, LopeLayer) else LopeLayer(module)
        layer.add(adapter_name, config.r, config.num_experts, config.alpha, config.noise_std,
                  config.dropout, config.use_rslora)
        return layer

    layers = inject(model, paths, wrap)
    set_modules_to_save(model, default_heads(model) if config.modules_to_save is None
                        else config.modules_to_save)
    mark_trainable(model, adapter_name)
    return layers


registry.register("method", "lope", LopeConfig, apply_lope, rebuild=rebuild_at_paths(apply_lope),
                  summary="LoPE: shared-A LoRA experts + a poisoning expert masked at inference (A6)")
