"""S'MoRE (Zeng et al., NeurIPS 2025; docs/adapters-mixture-prompt.md): config, layer, and the
registration."""
from __future__ import annotations

from dataclasses import asdict

from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import adapt, rebuild_at_paths
from rankwise.adapters.smore.config import SmoreConfig
from rankwise.adapters.smore.layer import SmoreLayer, SmoreTree
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
    settings = {k: v for k, v in asdict(config).items() if k in _LAYER_KEYS}

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, SmoreLayer) else SmoreLayer(module)
        layer.add(adapter_name, settings)
        return layer

    layers = adapt(model, config, adapter_name, wrap)
    track_token_mask(model)  # padding stays out of the balance loss and the load
    return layers


registry.register("method", "smore", SmoreConfig, apply_smore, rebuild=rebuild_at_paths(apply_smore),
                  summary="S'MoRE: hierarchical residual experts routed as a tree (A5)")
