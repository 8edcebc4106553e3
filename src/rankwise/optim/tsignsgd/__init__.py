"""t-SignSGD, LoTA-QAF's optimizer (arXiv 2505.18724; docs/lota-qaf.md); importing registers
``t-signsgd``."""
from rankwise import registry
from rankwise.optim.tsignsgd.config import TSignSGDConfig
from rankwise.optim.tsignsgd.optimizer import (TSignSGD, build_tsignsgd, quantile_at,
                                               ternary_parameters, tsignsgd_state_floats)

# No gradient clipping by default: LoTA-QAF's authors train without it, and a clip to 1 would
# keep the gradient norm below the spike guard's 10 so the guard never fires.
registry.register("optimizer", "t-signsgd", TSignSGDConfig, build_tsignsgd,
                  summary="t-SignSGD: +-1 grid steps for LoTA-QAF's ternary adapters (no lr)",
                  state_floats=tsignsgd_state_floats, lr_grid=(1e-3, 3e-3, 1e-2), grad_clip=None)

__all__ = ["TSignSGD", "TSignSGDConfig", "build_tsignsgd", "quantile_at", "ternary_parameters",
           "tsignsgd_state_floats"]
