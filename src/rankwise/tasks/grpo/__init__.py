"""The ``grpo`` task (Group Relative Policy Optimization): the loss and rollout, its prompt
records, the rewards, GAIN-RL's data order, the registration."""
from rankwise import registry
from rankwise.tasks.grpo.task import GRPOConfig, GRPOTask

registry.register("task", GRPOTask.name, GRPOConfig, GRPOTask,
                  summary="grpo (AutoModelForCausalLM; prompts + rewards, section grpo:)")
