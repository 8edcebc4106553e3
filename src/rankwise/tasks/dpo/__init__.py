"""The ``dpo`` task (Direct Preference Optimization): the loss and the registration (its records are
the pair tasks', :mod:`rankwise.tasks.pairs`)."""
from rankwise import registry
from rankwise.tasks.dpo.task import DPOConfig, DPOTask

registry.register("task", DPOTask.name, DPOConfig, DPOTask,
                  summary="dpo (AutoModelForCausalLM; preference pairs {prompt, chosen, rejected}; task.beta, task.loss)")
