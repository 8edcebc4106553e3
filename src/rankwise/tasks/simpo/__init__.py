"""The ``simpo`` task (SimPO, and CPO's losses): the loss, the registration."""
from rankwise import registry
from rankwise.tasks.simpo.task import SimPOConfig, SimPOTask

registry.register("task", SimPOTask.name, SimPOConfig, SimPOTask,
                  summary="simpo (AutoModelForCausalLM; preference pairs {prompt, chosen, rejected}, "
                          "no reference model; task.loss simpo | sigmoid (CPO) | hinge | ipo, task.beta, task.gamma)")
