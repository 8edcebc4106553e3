"""The ``rloo`` task (REINFORCE Leave-One-Out): its loss and advantage, the registration; the
sampling, prompts, rewards and ``samples.jsonl`` are the ``grpo`` task's."""
from rankwise import registry
from rankwise.tasks.rloo.config import RLOOConfig
from rankwise.tasks.rloo.task import RLOOTask

registry.register("task", RLOOTask.name, RLOOConfig, RLOOTask,
                  summary="rloo (AutoModelForCausalLM; prompts + task.rewards, k samples, leave-one-out baseline)")
