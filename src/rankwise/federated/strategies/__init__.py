"""Federated strategies (FedIT, FFA-LoRA, RoLoRA, FedLEASE, YOCO, LEFF; papers and readings in
docs/federated.md), each registered once as kind ``"strategy"``.

The registered builder is the strategy class: on the server
``cls(config, fed, initial_state, train_config, roles=...)``; on a client its class-level hooks
(:class:`~rankwise.federated.strategies.client_hooks.ClientHooks`).
"""
from __future__ import annotations

from rankwise import registry
from rankwise.federated.strategies.base import AdapterStrategy, Plan, Update
from rankwise.federated.strategies.fedlease import FedLease, FedLeaseConfig
from rankwise.federated.strategies.leff import Leff, LeffConfig
from rankwise.federated.strategies.lora_avg import (FedIt, FedItConfig, FfaLora, FfaLoraConfig,
                                                    RoLora, RoLoraConfig, average_present)
from rankwise.federated.strategies.yoco import Yoco, YocoConfig

__all__ = ["AdapterStrategy", "Plan", "Update", "FedIt", "FfaLora", "RoLora", "FedLease", "Yoco",
           "Leff", "average_present"]

registry.register("strategy", "fedit", FedItConfig, FedIt,
                  summary="FedAvg of LoRA A and B (FedIT, Zhang et al. 2024)")
registry.register("strategy", "ffa-lora", FfaLoraConfig, FfaLora,
                  summary="A frozen, B averaged (FFA-LoRA, Sun et al. 2024)")
registry.register("strategy", "rolora", RoLoraConfig, RoLora,
                  summary="alternate B / A rounds, exact aggregation, half the bytes (RoLoRA 2025)")
registry.register("strategy", "fedlease", FedLeaseConfig, FedLease,
                  summary="clustered LoRA experts + adaptive top-M router (FedLEASE 2025)")
registry.register("strategy", "yoco", YocoConfig, Yoco,
                  summary="one-shot: sign-regularised B, sparse A, PCA aggregation of A (YOCO 2025)")
registry.register("strategy", "leff", LeffConfig, Leff,
                  summary="capacity-sized layer blocks sampled by importance (LEFF 2025)")
