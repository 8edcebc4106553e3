"""The ``lowrank`` method (Schotthoefer et al., NeurIPS 2025; docs/optimizers.md): factorized
``U S V^T`` layers, trained by the geometric
optimizers ``lowrank-hb`` / ``lowrank-adam`` (or any optimizer on the factors)."""
from __future__ import annotations

from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import adapt, rebuild_at_paths
from rankwise.adapters.lowrank.config import LowRankConfig
from rankwise.adapters.lowrank.layer import LowRankLayer, released_weight

__all__ = ["LowRankConfig", "LowRankLayer", "apply_lowrank", "released_weight"]


def apply_lowrank(model: nn.Module, config: LowRankConfig, adapter_name: str = "default",
                  structure: dict[str, dict] | None = None) -> dict[str, LowRankLayer]:
    """Factorize the target layers of ``model`` and make only the factors (and heads) trainable.

    Args:
        model: Any module with linear layers.
        config: The method settings.
        adapter_name: Name of the factorization.
        structure: Optional per-path ``{"rank", "mode"}`` overriding the config (loading).

    Returns:
        ``{path: LowRankLayer}``.

    Raises:
        RankwiseError: On targets matching nothing or a rank larger than a layer.
    """
    structure = structure or {}

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, LowRankLayer) else LowRankLayer(module)
        s = structure.get(path, {})
        layer.add(adapter_name, int(s.get("rank", config.rank)), str(s.get("mode", config.mode)))
        return layer

    return adapt(model, config, adapter_name, wrap)


# rebuild: the saved {path: {"rank", "mode"}} at those paths
registry.register("method", "lowrank", LowRankConfig, apply_lowrank,
                  rebuild=rebuild_at_paths(apply_lowrank, structure=True),
                  summary="factorized U S V^T layers (adapter W0 + USV^T, or factorized USV^T)")
