"""S'MoRE (ROADMAP A5): config, layer, and the registration."""
from __future__ import annotations

from dataclasses import asdict

from torch import nn

from rankwise import registry
from rankwise.adapters.smore.config import SmoreConfig
from rankwise.adapters.smore.layer import SmoreLayer, SmoreTree
from rankwise.adapters.targets import rebuild_at_paths
from rankwise.core.inject import default_heads, find_targets, inject
from rankwise.core.ops import mark_trainable, set_modules_to_save
from rankwise.core.quant import keep_training_layout
from rankwise.core.token_mask import track_token_mask

__all__ = ["SmoreConfig", "SmoreLayer", "SmoreTree", "apply_smore"]

_LAYER_KEYS = ("ranks", "experts", "fanout", "gate_dims", "down_dim", "alpha", "expert_act",
               "gate_act", "balance_weight")


def apply_smore(model: nn.Module, config: SmoreConfig, adapter_name: str = "default"
                ) -> dict[str, SmoreLayer]:
    """Inject S'MoRE adapter ``adapter_name`` into every target layer; only it (and the task
    head) trains.

    Args:
        model: Any module with linear layers.
        config: The level structure and routing settings.
        adapter_name: Name of the adapter.

    Returns:
        ``{path: SmoreLayer}``.

    Raises:
        RankwiseError: If the targets match no linear layer.
    """
    paths = find_targets(model, config.targets, config.exclude, "method.targets")
    keep_training_layout(model)  # 4-bit bases: no CPU inference repacking while adapted
    settings = {k: v for k, v in asdict(config).items() if k in _LAYER_KEYS}

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, SmoreLayer) else SmoreLayer(module)
        layer.add(adapter_name, settings)
        return layer

    layers = inject(model, paths, wrap)
    track_token_mask(model)  # padding stays out of the balance loss and the load
    set_modules_to_save(model, default_heads(model) if config.modules_to_save is None
                        else config.modules_to_save)
    mark_trainable(model, adapter_name)
    return layers


registry.register("method", "smore", SmoreConfig, apply_smore, rebuild=rebuild_at_paths(apply_smore),
                  summary="S'MoRE: hierarchical residual experts routed as a tree (A5)")
