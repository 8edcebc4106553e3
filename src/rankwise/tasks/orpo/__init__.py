"""The ``orpo`` task (Odds Ratio Preference Optimization): the loss, the registration."""
from rankwise import registry
from rankwise.tasks.orpo.task import ORPOConfig, ORPOTask

registry.register("task", ORPOTask.name, ORPOConfig, ORPOTask,
                  summary="orpo (AutoModelForCausalLM; preference pairs {prompt, chosen, rejected}, "
                          "no reference model; task.beta = lambda)")
