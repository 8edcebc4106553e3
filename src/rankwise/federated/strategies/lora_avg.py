"""FedAvg-family strategies over LoRA factors: FedIT, FFA-LoRA and RoLoRA.

With one LoRA pair per client, averaging the factors separately is inexact:
``mean_i(B_i) mean_i(A_i) = (1/N^2) sum_ij B_i A_j != (1/N) sum_i B_i A_i`` (the i != j terms
are cross-client interference). FFA-LoRA never trains A; RoLoRA trains one factor per round
with the other frozen and equal on every client, so ``mean_i(B_i) A = mean_i(B_i A)`` exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rankwise.federated.strategies.base import AdapterStrategy, Plan, Update


def average_present(updates: list[Update]) -> dict[str, torch.Tensor]:
    """Per key, the example-weighted mean over the updates that contain the key.

    When every update holds every key this is FedAvg; when clients train different subsets
    (LEFF's blocks) each key is averaged over the clients that trained it.

    Args:
        updates: Accepted client updates.

    Returns:
        ``{name: averaged tensor}`` for every key present in at least one update.
    """
    sums: dict[str, torch.Tensor] = {}
    weights: dict[str, float] = {}
    for u in updates:
        for k, v in u.state.items():
            sums[k] = sums.get(k, torch.zeros(v.shape, dtype=torch.float64)) + u.weight * v.double()
            weights[k] = weights.get(k, 0.0) + u.weight
    return {k: (sums[k] / weights[k]).float() for k in sums}


@dataclass
class FedItConfig:
    """FedIT: FedAvg of both LoRA factors (Zhang et al., ICASSP 2024). No options.

    Attributes:
        name: Registry name.
    """

    name: str = "fedit"


class FedIt(AdapterStrategy):
    """FedIT (Zhang et al. 2024, "Towards Building the Federated GPT"): every client trains A and
    B; the server averages each factor separately, weighted by examples (FedAvg, McMahan et al.
    2017, Alg. 1 line "w <- sum_k n_k/n w_k"). Inexact for the product (see module docstring).
    """

    name = "fedit"

    def aggregate_updates(self, server_round: int, updates: list[Update]) -> list[str]:
        """Replace each sent key by its weighted mean; return the changed keys."""
        new = average_present(updates)
        self.global_state.update(new)
        return list(new)


@dataclass
class FfaLoraConfig:
    """FFA-LoRA (Sun et al., ICLR 2024). No options.

    Attributes:
        name: Registry name.
    """

    name: str = "ffa-lora"


class FfaLora(FedIt):
    """FFA-LoRA (Sun et al. 2024, "Improving LoRA in privacy-preserving federated learning",
    Sec. 4): A stays at its shared random initialisation; clients train and send only B (and
    non-LoRA trainables such as the task head); the server averages B, which is exact because
    A is identical everywhere.
    """

    name = "ffa-lora"
    needs_factors = True

    def plan(self, server_round: int, node_id: int) -> Plan:
        """Train B (never A)."""
        return Plan(factors="B")


@dataclass
class RoLoraConfig:
    """RoLoRA settings.

    Attributes:
        name: Registry name.
        first_factor: The factor trained in round 1 (the paper's Algorithm 1 starts with B,
            the zero-initialised up-projection, with A frozen).
    """

    name: str = "rolora"
    first_factor: Literal["B", "A"] = "B"


class RoLora(FedIt):
    """RoLoRA (Chen et al., NeurIPS 2025, arXiv 2502.01755, Alg. 1): odd rounds freeze the shared
    A and train/send B only, even rounds freeze the new B and train/send A only; the server
    averages the half it received and keeps the other half, so the aggregate of ``B A`` is
    exact and each round moves half the bytes of FedIT.

    Choice where the paper is silent: trainables that are not LoRA factors (a task head) train
    and travel every round; the halving is exact for the LoRA tensors.
    """

    name = "rolora"
    needs_factors = True

    def plan(self, server_round: int, node_id: int) -> Plan:
        """``first_factor`` in odd rounds, the other one in even rounds."""
        other = "A" if self.config.first_factor == "B" else "B"
        return Plan(factors=self.config.first_factor if server_round % 2 == 1 else other)
