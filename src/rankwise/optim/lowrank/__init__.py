"""Geometric low-rank momentum (Schotthoefer et al., NeurIPS 2025; docs/optimizers.md);
importing registers ``lowrank-hb`` and
``lowrank-adam`` (for layers of the ``lowrank`` method)."""
from rankwise import registry
from rankwise.optim.lowrank import geometry
from rankwise.optim.lowrank.config import LowRankAdamConfig, LowRankHBConfig
from rankwise.optim.lowrank.optimizer import (LowRankMomentum, build_lowrank_adam, build_lowrank_hb,
                                              lowrank_adam_state_floats, lowrank_hb_state_floats,
                                              lowrank_param_groups)

registry.register("optimizer", "lowrank-hb", LowRankHBConfig, build_lowrank_hb,
                  summary="heavy ball on the rank-r manifold (lowrank layers; augment + truncate)",
                  state_floats=lowrank_hb_state_floats, lr_grid=(1e-3, 3e-3, 1e-2))
registry.register("optimizer", "lowrank-adam", LowRankAdamConfig, build_lowrank_adam,
                  summary="Adam on the rank-r manifold (lowrank layers; augment + truncate)",
                  state_floats=lowrank_adam_state_floats, lr_grid=(3e-3, 1e-2, 3e-2))

__all__ = ["LowRankAdamConfig", "LowRankHBConfig", "LowRankMomentum", "build_lowrank_adam",
           "build_lowrank_hb", "geometry", "lowrank_adam_state_floats", "lowrank_hb_state_floats",
           "lowrank_param_groups"]
