"""Training objectives, one package each, registered as kind ``task``. Importing this package
registers every built-in task."""
from rankwise import registry
from rankwise.engine.task import CausalLMTask, ClassificationTask

for _cls in (ClassificationTask, CausalLMTask):
    registry.register("task", _cls.name, dict, _cls, summary=f"{_cls.name} ({_cls.auto_class})")

from rankwise.tasks import dpo  # noqa: E402,F401  (registers "dpo")
from rankwise.tasks import grpo  # noqa: E402,F401  (registers "grpo")
from rankwise.tasks import memory_decoder  # noqa: E402,F401  (registers "memory-decoder")
