"""The step schedules and data orders a run chooses, as registry entries.

Two kinds of entry decide what the engine's ``schedule`` is (:class:`~rankwise.engine.Engine`):

* kind ``schedule`` (``data.schedule: {name: ..., its keys}``): how a global step's examples are
  grouped into processes and micro-batches. ``none`` keeps draw order; ``skrull`` groups them by
  cost (:mod:`rankwise.engine.skrull`, ``docs/skrull.md``). Builder
  ``(config, model, world, rank, grad_accum) -> schedule | None``.
* kind ``order`` (``data.order: {name: ...}``): which examples each step draws. ``uniform`` is a
  fresh permutation per epoch; a task may register its own (GRPO's ``gain-rl``,
  :mod:`rankwise.tasks.grpo`), naming the tasks it serves in the capability ``tasks``. Builder
  ``(config, task, run, model, train_data, device, distributed) -> schedule | None``.

A bare name (``data.schedule: skrull``) is the mapping with that name and default settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from rankwise import registry
from rankwise.configs import KEY_HINTS, bounded
from rankwise.engine.skrull import Skrull


@dataclass
class NoScheduleConfig:
    """``data.schedule: none``: each process takes a contiguous share of the step's examples in
    draw order, cut into equal micro-batches.

    Attributes:
        name: The schedule.
    """

    name: str = "none"


@dataclass
class SkrullConfig:
    """``data.schedule: skrull``: Skrull's global data scheduling (Xu et al. 2025, arXiv
    2505.19609; its context parallelism is not implemented): examples grouped by the cost model
    ``a L + b L^2``, longest-processing-time first over processes, then into padding-aware
    micro-batches; the same examples and loss per step (:mod:`rankwise.engine.skrull`,
    ``docs/skrull.md``).

    Attributes:
        name: The schedule.
        linear: ``a / b`` of the cost model, in tokens (``null``: 12 x the model's hidden size).
        bucket: The memory cap (the paper's BucketSize): the most padded tokens ``n x L_max`` of
            one micro-batch (``null``: no cap). A longer sequence is refused (rankwise has no
            context parallelism to split it).
    """

    name: str = "skrull"
    linear: Union[float, None] = bounded(None, gt=0, what="tokens")
    bucket: Union[int, None] = bounded(None, gt=0, what="padded tokens")


@dataclass
class UniformOrderConfig:
    """``data.order: uniform``: every epoch a fresh seeded permutation of the training examples.

    Attributes:
        name: The order.
    """

    name: str = "uniform"


def no_schedule(config: NoScheduleConfig, model: Any, world: int, rank: int, grad_accum: int) -> None:
    """Draw order: the engine's default (no schedule object)."""
    return None


def skrull_schedule(config: SkrullConfig, model: Any, world: int, rank: int, grad_accum: int) -> Skrull:
    """This process's :class:`~rankwise.engine.skrull.Skrull` schedule."""
    return Skrull.for_model(model, world, rank, grad_accum, config.linear, config.bucket)


def uniform_order(config: UniformOrderConfig, task: Any, run: Any, model: Any, train_data: Any,
                  device: str, distributed: bool) -> None:
    """The engine's own draw (no schedule object)."""
    return None


for _key in ("linear", "bucket"):  # Skrull's keys given to another schedule
    KEY_HINTS[f"data.schedule.{_key}"] = (f"{_key} is a setting of Skrull's schedule; set "
                                          f"data.schedule: {{name: skrull, {_key}: ...}} or remove it")

registry.register("schedule", "none", NoScheduleConfig, no_schedule,
                  summary="contiguous shares of each step in draw order")
registry.register("schedule", "skrull", SkrullConfig, skrull_schedule,
                  summary="Skrull: cost-balanced processes and padding-aware micro-batches")
registry.register("order", "uniform", UniformOrderConfig, uniform_order,
                  summary="a fresh seeded permutation per epoch")

__all__ = ["NoScheduleConfig", "SkrullConfig", "UniformOrderConfig"]
