"""The ``memory-decoder`` task: the kNN-LM imitation loss and datastore, decoding with a base,
the registration."""
from rankwise import registry
from rankwise.tasks.memory_decoder.task import MemoryDecoderConfig, MemoryDecoderTask

registry.register("task", MemoryDecoderTask.name, MemoryDecoderConfig, MemoryDecoderTask,
                  summary="memory-decoder (AutoModelForCausalLM; imitates task.base's kNN-LM distribution)")
