"""The training engine: one loop (:class:`Engine`) with callbacks, and the :class:`Task`
objects that turn examples into losses and metrics. Importing it registers the tasks."""
from rankwise import registry
from rankwise.engine.loop import (Engine, NonFiniteLoss, StepResult, TrainState, batch_indices,
                                  evaluate, linear_schedule)
from rankwise.engine.memory_decoder import MemoryDecoderConfig, MemoryDecoderTask
from rankwise.engine.grpo import GRPOConfig, GRPOTask
from rankwise.engine.preference import DPOConfig, DPOTask
from rankwise.engine.task import CausalLMTask, ClassificationTask, Task

for _cls in (ClassificationTask, CausalLMTask):
    registry.register("task", _cls.name, dict, _cls, summary=f"{_cls.name} ({_cls.auto_class})")
registry.register("task", DPOTask.name, DPOConfig, DPOTask,
                  summary="dpo (AutoModelForCausalLM; preference pairs, section dpo:)")
registry.register("task", MemoryDecoderTask.name, MemoryDecoderConfig, MemoryDecoderTask,
                  summary="memory-decoder (AutoModelForCausalLM; kNN-LM imitation, section memory_decoder:)")
registry.register("task", GRPOTask.name, GRPOConfig, GRPOTask,
                  summary="grpo (AutoModelForCausalLM; prompts + rewards, section grpo:)")


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
