"""SUMO optimizer; importing registers ``sumo``."""
from rankwise import registry
from rankwise.optim.common import subspace_state_floats
from rankwise.optim.sumo.config import SumoConfig
from rankwise.optim.sumo.optimizer import SumoOptimizer, build_sumo, orthogonalize, polar_batch

registry.register("optimizer", "sumo", SumoConfig, build_sumo,
                  summary="SUMO: subspace momentum, exactly orthogonalized (nr+mr state)",
                  state_floats=subspace_state_floats(moments=1), lr_grid=(3e-3, 1e-2, 3e-2))

__all__ = ["SumoConfig", "SumoOptimizer", "build_sumo", "orthogonalize", "polar_batch"]
