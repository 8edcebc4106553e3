"""SUMO optimizer; importing registers ``sumo``."""
from rankwise import registry
from rankwise.optim.sumo.config import SumoConfig
from rankwise.optim.sumo.optimizer import SumoOptimizer, build_sumo, orthogonalize

registry.register("optimizer", "sumo", SumoConfig, build_sumo,
                  summary="SUMO: subspace momentum orthogonalized by exact SVD (nr+mr state)")

__all__ = ["SumoConfig", "SumoOptimizer", "build_sumo", "orthogonalize"]
