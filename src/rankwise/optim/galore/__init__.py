"""GaLore-style optimizers; importing registers ``galore`` and ``galore-is``."""
from rankwise import registry
from rankwise.optim.common import subspace_state_floats
from rankwise.optim.galore.config import GaLoreConfig, GaLoreISConfig
from rankwise.optim.galore.optimizer import GaLoreAdamW, build_galore, galore_param_groups

# lr_grid: the lowrank-pretrain sweep (scale 0.25 shrinks the step, so it sits 10x above AdamW's).
registry.register("optimizer", "galore", GaLoreConfig, build_galore,
                  summary="GaLore: Adam moments in the gradient's top-r subspace (2nr+mr state)",
                  state_floats=subspace_state_floats(moments=2), lr_grid=(1e-2, 3e-2, 1e-1))
registry.register("optimizer", "galore-is", GaLoreISConfig, build_galore,
                  summary="GaLore with importance-sampled subspaces (Zhang et al. 2025)",
                  state_floats=subspace_state_floats(moments=2), lr_grid=(1e-2, 3e-2, 1e-1))

__all__ = ["GaLoreAdamW", "GaLoreConfig", "GaLoreISConfig", "build_galore", "galore_param_groups"]
