"""NGN-M optimizer; importing registers ``ngn-m``."""
from rankwise import registry
from rankwise.optim.ngn.config import NGNMConfig
from rankwise.optim.ngn.optimizer import NGNM, build_ngnm, ngn_step_size

registry.register("optimizer", "ngn-m", NGNMConfig, build_ngnm,
                  summary="NGN-M: NGN adaptive step size with heavy-ball momentum")

__all__ = ["NGNM", "NGNMConfig", "build_ngnm", "ngn_step_size"]
