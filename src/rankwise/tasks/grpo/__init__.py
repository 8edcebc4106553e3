"""The ``grpo`` task (Group Relative Policy Optimization): the loss and rollout, its prompt
records, the rewards, GAIN-RL's data order, the registrations (the task, and the order
``gain-rl`` that serves it)."""
from rankwise import registry
from rankwise.tasks.grpo.config import GainRLConfig, GRPOConfig
from rankwise.tasks.grpo.task import GRPOTask, gain_rl_order

registry.register("task", GRPOTask.name, GRPOConfig, GRPOTask,
                  summary="grpo (AutoModelForCausalLM; prompts + task.rewards, sampled groups)")
registry.register("order", "gain-rl", GainRLConfig, gain_rl_order, tasks=(GRPOTask.name,),
                  summary="GAIN-RL: prompts by angle concentration, a Gaussian sampler (task grpo)")
