"""The ``grpo`` task (Group Relative Policy Optimization): the loss and rollout, its prompt
records, the rewards, GAIN-RL's data order, the registration."""
from rankwise import registry
from rankwise.tasks.grpo.config import GRPOConfig
from rankwise.tasks.grpo.task import GRPOTask

registry.register("task", GRPOTask.name, GRPOConfig, GRPOTask,
                  summary="grpo (AutoModelForCausalLM; prompts + task.rewards, sampled groups)")
