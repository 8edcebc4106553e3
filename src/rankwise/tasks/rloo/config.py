"""The settings of the ``rloo`` task: ``task: {name: rloo, ...}`` (:class:`RLOOConfig`): GRPO's
shared settings (:class:`~rankwise.tasks.grpo.config.RolloutConfig`: rewards, sampling, the
reference) and RLOO's own; the objective is :mod:`rankwise.tasks.rloo.task`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

from rankwise.configs import bounded
from rankwise.tasks.grpo.config import RolloutConfig


@dataclass
class RLOOConfig(RolloutConfig):
    """The ``task:`` section of ``task: {name: rloo}``. Defaults are TRL 1.16's ``RLOOConfig``'s
    (``num_generations`` 2, ``beta`` 0.05, ``epsilon`` 0.2, ``normalize_advantages`` off) except
    ``disable_dropout`` (on, as for GRPO and DPO) and ``max_completion_length`` (128, GRPO's).

    Attributes:
        name: ``rloo``.
        num_generations: ``k``, completions per prompt (>= 2: the baseline of each is the mean
            reward of the other ``k - 1``).
        beta: Strength of the KL penalty in the reward, ``r - beta * sum_t (logp - ref)`` (0: no
            reference forward).
        normalize_advantages: Standardise the leave-one-out advantages over the step (every
            micro-batch of every process; TRL: the generation batch) to mean 0 and std 1
            (Bessel's, ``+ 1e-4``).
        reward_clip_range: ``[low, high]``: clamp each reward (the weighted sum, before the KL
            penalty) into it (TRL's ``reward_clip_range``); ``null``: no clipping.
    """

    name: str = "rloo"
    num_generations: int = bounded(2, ge=2, hint="(RLOO's baseline of a completion is the mean reward "
                                                 "of the other k - 1 of its prompt)")
    beta: float = bounded(0.05, ge=0)
    normalize_advantages: bool = False
    reward_clip_range: Union[list[float], None] = None

    def problems(self) -> list[str]:
        """Return value errors (:class:`RolloutConfig`'s and the clip range's)."""
        out = super().problems()
        clip = self.reward_clip_range
        if clip is not None and (len(clip) != 2 or not all(math.isfinite(float(v)) for v in clip)
                                 or float(clip[0]) > float(clip[1])):
            out.append(f"reward_clip_range: got {clip!r}; expected [low, high] with low <= high, "
                       "or null")
        return out


__all__ = ["RLOOConfig"]
