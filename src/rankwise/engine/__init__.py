"""The training engine: one loop (:class:`Engine`) with callbacks, and the :class:`Task`
protocol that turns examples into losses and metrics (the tasks themselves are the
:mod:`rankwise.tasks` family, registered as kind ``task``)."""
from rankwise import registry
from rankwise.engine.loop import (Engine, NonFiniteLoss, StepResult, TrainState, batch_indices,
                                  evaluate, linear_schedule)
from rankwise.engine.task import Task, TaskConfig


def get_task(task: "str | TaskConfig", config: TaskConfig | None = None) -> Task:
    """The registered task, built from its config.

    Args:
        task: A task config (the run config's ``task:`` section, whose ``name`` picks the
            task), or a task name (``classification``, ``causal-lm``, ``dpo``, ...).
        config: With a name: the task's config (default: its defaults).

    Returns:
        The task.

    Raises:
        RankwiseError: Unknown task (the message lists the registered ones).
    """
    if not isinstance(task, str):
        task, config = task.name, task
    builder = registry.get("task", task).builder
    return builder(config) if config is not None else builder()


def task_class(name: str) -> type[Task]:
    """The :class:`Task` subclass registered as ``name`` (its class attributes: ``uses_labels``,
    ``lm_loss``, ``auto_class``), without building it.

    Raises:
        RankwiseError: Unknown task.
    """
    return registry.get("task", name).builder


__all__ = ["Engine", "NonFiniteLoss", "StepResult", "TrainState", "Task", "TaskConfig",
           "batch_indices", "evaluate", "get_task", "linear_schedule", "task_class"]
