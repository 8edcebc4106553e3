"""Low-Rank Clone distillation (``rankwise distill``, ``docs/distill.md``): a narrower student
whose weights are the frozen teacher's through trained projections, baked into a plain model.
Not a per-layer ``compressor``: it trains, so ``commands/distill/run.py`` wires it to the engine."""
from rankwise.compress.clone.config import DistillConfig
from rankwise.compress.clone.model import (LowRankClone, check_student, kl_teacher_student, lrc_losses,
                                           masked_mse, student_config)

__all__ = ["DistillConfig", "LowRankClone", "check_student", "kl_teacher_student", "lrc_losses",
           "masked_mse", "student_config"]
