"""The ``kto`` task (Kahneman-Tversky Optimization): the loss, its records, the registration."""
from rankwise import registry
from rankwise.tasks.kto.task import KTOConfig, KTOTask

registry.register("task", KTOTask.name, KTOConfig, KTOTask,
                  summary="kto (AutoModelForCausalLM; unpaired {prompt, completion, label} records; "
                          "task.beta, task.desirable_weight, task.undesirable_weight)")
