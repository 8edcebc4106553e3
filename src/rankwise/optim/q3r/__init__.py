"""Q3R rank regularizer; importing registers ``q3r``."""
from rankwise import registry
from rankwise.optim.q3r.config import Q3RConfig
from rankwise.optim.q3r.optimizer import (Q3RAdamW, build_q3r, q3r_operator, q3r_state_floats,
                                          q3r_value, reweight, reweight_tracked, target_rank)
from rankwise.optim.q3r.truncate import LowRankLinear, truncate_to_factorized

registry.register("optimizer", "q3r", Q3RConfig, build_q3r,
                  summary="AdamW + Q3R rank regularizer (train to rank r, then truncate)",
                  state_floats=q3r_state_floats, lr_grid=(1e-3, 3e-3, 1e-2))

__all__ = ["LowRankLinear", "Q3RAdamW", "Q3RConfig", "build_q3r", "q3r_operator", "q3r_state_floats",
           "q3r_value", "reweight", "reweight_tracked", "target_rank", "truncate_to_factorized"]
