"""GaLore-style optimizers; importing registers ``galore`` and ``galore-is``."""
from rankwise import registry
from rankwise.optim.galore.config import GaLoreConfig, GaLoreISConfig
from rankwise.optim.galore.optimizer import GaLoreAdamW, build_galore, galore_param_groups

registry.register("optimizer", "galore", GaLoreConfig, build_galore,
                  summary="GaLore: Adam moments in the gradient's top-r subspace (2nr+mr state)")
registry.register("optimizer", "galore-is", GaLoreISConfig, build_galore,
                  summary="GaLore with importance-sampled subspaces (Zhang et al. 2025)")

__all__ = ["GaLoreAdamW", "GaLoreConfig", "GaLoreISConfig", "build_galore", "galore_param_groups"]
