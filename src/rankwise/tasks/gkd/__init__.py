"""The ``gkd`` task (on-policy distillation, Generalized Knowledge Distillation): the generalized
JSD, the student's (or teacher's) sampled completions, the registration."""
from rankwise import registry
from rankwise.tasks.gkd.task import GKDConfig, GKDTask

registry.register("task", GKDTask.name, GKDConfig, GKDTask,
                  summary="gkd (AutoModelForCausalLM; prompt-completion records + task.teacher; "
                          "on-policy distillation: task.lmbda, task.beta)")
