"""NGN-M optimizer; importing registers ``ngn-m``."""
from rankwise import registry
from rankwise.optim.common import elementwise_state_floats
from rankwise.optim.ngn.config import NGNMConfig
from rankwise.optim.ngn.optimizer import NGNM, build_ngnm, ngn_step_size

# lr is NGN's c, the largest step it may take; the adaptive step is smaller, hence the grid.
# No gradient clipping by default: the step size's damping by ||g||^2 is the method (Islamov et
# al.), and a clipped norm would replace it by the clip.
registry.register("optimizer", "ngn-m", NGNMConfig, build_ngnm,
                  summary="NGN-M: NGN adaptive step size with heavy-ball momentum",
                  state_floats=elementwise_state_floats(1), lr_grid=(0.1, 0.3, 1.0), grad_clip=None)

__all__ = ["NGNM", "NGNMConfig", "build_ngnm", "ngn_step_size"]
