"""NanoAdam (Zhou et al., NeurIPS 2025; docs/optimizers.md); importing registers ``nanoadam``."""
from rankwise import registry
from rankwise.optim.nanoadam.config import NanoAdamConfig
from rankwise.optim.nanoadam.optimizer import (NanoAdam, build_nanoadam, nanoadam_param_groups,
                                               nanoadam_state_floats, scheduled_density,
                                               smallest_indices)

registry.register("optimizer", "nanoadam", NanoAdamConfig, build_nanoadam,
                  summary="NanoAdam: Adam on each tensor's smallest-magnitude weights only",
                  state_floats=nanoadam_state_floats, lr_grid=(1e-2, 3e-2, 1e-1))

__all__ = ["NanoAdam", "NanoAdamConfig", "build_nanoadam", "nanoadam_param_groups",
           "nanoadam_state_floats", "scheduled_density", "smallest_indices"]
