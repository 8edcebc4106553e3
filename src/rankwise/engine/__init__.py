"""The training engine: one loop (:class:`Engine`) with callbacks, and the :class:`Task`
protocol that turns examples into losses and metrics (the tasks themselves are the
:mod:`rankwise.tasks` family, registered as kind ``task``)."""
from rankwise import registry
from rankwise.engine.loop import (Engine, NonFiniteLoss, StepResult, TrainState, batch_indices,
                                  evaluate, linear_schedule)
from rankwise.engine.task import CausalLMTask, ClassificationTask, Task


def get_task(name: str, config=None) -> Task:
    """The registered task ``name`` (``classification``, ``causal-lm``, ``dpo``), instantiated
    with its config section (``dpo:``) when given.

    Raises:
        RankwiseError: Unknown task (the message lists the registered ones).
    """
    builder = registry.get("task", name).builder
    return builder(config) if config is not None else builder()


__all__ = ["Engine", "NonFiniteLoss", "StepResult", "TrainState", "Task", "ClassificationTask",
           "CausalLMTask", "batch_indices", "evaluate", "get_task", "linear_schedule"]
