"""The ``reward`` task (a reward model on preference pairs, Bradley-Terry): the loss, its records, the registration."""
from rankwise import registry
from rankwise.tasks.reward.task import RewardConfig, RewardTask

registry.register("task", RewardTask.name, RewardConfig, RewardTask,
                  summary="reward (AutoModelForSequenceClassification, one output; preference pairs "
                          "{prompt, chosen, rejected[, margin]}; Bradley-Terry)")
