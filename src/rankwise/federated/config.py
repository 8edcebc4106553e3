"""The ``federated:`` section of a run config: the one place its defaults live."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from rankwise.configs import bounded

FAULTS = ("nan", "shape", "keys", "crash")


@dataclass
class FederatedConfig:
    """How a federated run is set up (``rankwise federated``).

    Attributes:
        strategy: A strategy name (``fedit``, ``ffa-lora``, ``rolora``, ``fedlease``, ``yoco``,
            ``leff``) or a mapping ``{name: ..., <option>: ...}`` overriding that strategy's
            config dataclass.
        clients: Number of simulated clients (Flower SuperNodes), one data partition each.
        rounds: Communication rounds (YOCO always runs exactly one).
        partition: ``natural`` (each client an organisation owning whole labels, i.e. whole
            stdlib packages; strongly non-IID) or ``dirichlet`` (``flwr-datasets``'
            DirichletPartitioner over the labels).
        alpha: Dirichlet concentration (smaller = more skewed).
        fraction: Fraction of connected clients sampled per round (at least ``min_clients``).
        min_clients: A round is aggregated when at least this many valid updates arrive;
            otherwise the global adapter stays unchanged and the round is logged as skipped.
        local_steps: Optimiser steps per client per round.
        lr: Client learning rate; ``None`` uses the run's ``train.lr``.
        batch_size: Client batch size; ``None`` uses the run's ``train.batch_size``.
        round_timeout: Seconds the server waits for replies; late clients count as missing.
        client_cpus: CPUs Flower's simulation engine reserves per ClientApp (sets parallelism).
        seed: Seed of partitioning and sampling (the initial adapter comes from ``train.seed``).
        head: ``train`` (the task head trains and travels with the adapter) or ``frozen`` (it
            stays at its seeded initialisation on every client and never travels: FedBABU,
            Oh et al., ICLR 2022, for label-skewed clients).
        proximal_mu: FedProx's proximal term (Li et al., MLSys 2020, eq. 2): each client adds
            ``(mu / 2) * ||w - w_global||^2`` over the tensors it trains in the round, ``w_global``
            being the values it received; 0 turns it off.
        faults: Fault injection for tests and drills: ``{partition id: kind}`` with kind in
            ``nan``, ``shape``, ``keys`` (malformed updates) or ``crash`` (the ClientApp raises).
    """

    strategy: Union[str, dict] = "fedit"
    clients: int = bounded(4, ge=1)
    rounds: int = bounded(5, ge=1)
    partition: Literal["natural", "dirichlet"] = "natural"
    alpha: float = bounded(0.5, gt=0)
    fraction: float = bounded(1.0, gt=0.0, le=1.0)
    min_clients: int = 2
    local_steps: int = bounded(10, ge=1)
    lr: Union[float, None] = None
    batch_size: Union[int, None] = None
    round_timeout: float = 600.0
    client_cpus: float = 1.0
    seed: int = 0
    head: Literal["train", "frozen"] = "train"
    proximal_mu: float = bounded(0.0, ge=0, hint="(0 = off)")
    faults: dict[str, str] = field(default_factory=dict)

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        out = []
        if not 1 <= self.min_clients <= max(self.clients, 1):
            out.append(f"min_clients: got {self.min_clients}; expected 1..clients ({self.clients})")
        for pid, kind in self.faults.items():
            if kind not in FAULTS:
                out.append(f"faults.{pid}: got {kind!r}; expected one of {list(FAULTS)}")
            if not str(pid).isdigit():
                out.append(f"faults: key {pid!r} must be a partition id (0..clients-1)")
        if not isinstance(self.strategy, (str, dict)) or (
                isinstance(self.strategy, dict) and "name" not in self.strategy):
            out.append(f"strategy: got {self.strategy!r}; expected a name or {{name: ..., ...}}")
        return out

    def strategy_name(self) -> str:
        """The strategy's registry name."""
        return self.strategy if isinstance(self.strategy, str) else self.strategy["name"]

    def strategy_options(self) -> dict:
        """The overrides of the strategy's config dataclass (without ``name``)."""
        return {} if isinstance(self.strategy, str) else {
            k: v for k, v in self.strategy.items() if k != "name"}
