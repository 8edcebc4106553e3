"""Training objectives, one package each, registered as kind ``task`` (``task: {name: ...}``).

Importing this package registers every built-in task: ``classification`` and ``causal-lm``
(:mod:`rankwise.tasks.common`), ``dpo``, ``kto``, ``orpo``, ``simpo``, ``reward``, ``grpo``, ``rloo``, ``gkd`` (on-policy distillation) and ``memory-decoder``. A new task is one package here (its config, its
task, its records) with ONE ``registry.register("task", ...)``, imported below
(``docs/architecture.md``, "How to add a task").
"""
from rankwise.tasks import common  # noqa: F401  (registers "classification", "causal-lm")
from rankwise.tasks import dpo  # noqa: F401  (registers "dpo")
from rankwise.tasks import gkd  # noqa: F401  (registers "gkd")
from rankwise.tasks import grpo  # noqa: F401  (registers "grpo")
from rankwise.tasks import kto  # noqa: F401  (registers "kto")
from rankwise.tasks import memory_decoder  # noqa: F401  (registers "memory-decoder")
from rankwise.tasks import orpo  # noqa: F401  (registers "orpo")
from rankwise.tasks import reward  # noqa: F401  (registers "reward")
from rankwise.tasks import rloo  # noqa: F401  (registers "rloo")
from rankwise.tasks import simpo  # noqa: F401  (registers "simpo")
from rankwise.tasks.common import CausalLMConfig, CausalLMTask, ClassificationConfig, ClassificationTask

__all__ = ["CausalLMConfig", "CausalLMTask", "ClassificationConfig", "ClassificationTask"]
