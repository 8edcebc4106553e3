"""Mixtures of LoRA experts behind a router: the layer and the model glue.

Not a user-facing method yet (no registration): FedLEASE builds its client models from it,
and a ``moe-lora`` method can register here later.
"""
from rankwise.adapters.mixture.layer import (Gate, LoraExpert, LoraMixture, MixtureLoraLayer,
                                             TopKGate, own_expert_slots)
from rankwise.adapters.mixture.model import factorized_to_mixture

__all__ = ["Gate", "LoraExpert", "LoraMixture", "MixtureLoraLayer", "TopKGate", "own_expert_slots",
           "factorized_to_mixture"]
