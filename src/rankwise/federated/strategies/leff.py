"""LEFF: layer-wise efficient federated fine-tuning (Shen et al., NeurIPS 2025, "LLM at Network
Edge"; OpenReview DqRbfiTdKK). No official code exists; choices are in the class docstring."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import nn

from rankwise.configs import bounded
from rankwise.engine import Task, batch_indices
from rankwise.federated import keys
from rankwise.federated.payload import layer_index
from rankwise.federated.strategies.base import AdapterStrategy, Plan, Update
from rankwise.federated.strategies.lora_avg import average_present


@dataclass
class LeffConfig:
    """LEFF settings.

    Attributes:
        name: Registry name.
        capacities: Layers each client can train, by partition id (cycled when shorter than the
            number of clients). A SuperNode started with ``--node-config "capacity=N"``
            overrides its entry.
        temperature: Softmax temperature over block importances; 1 is the paper's plain
            softmax of block importance.
        normalize: Divide importances by their sum before the softmax (the reading used
            before the paper's plain softmax was restored; off by default).
        refresh: Clients measure the importance again in every round they train (on the
            global model they received); ``false``: only on first contact, so the full
            backward over all base weights runs once per client instead of once per round
            (the sampling then keeps the first round's probabilities).
    """

    name: str = "leff"
    capacities: list[int] = field(default_factory=lambda: [1, 2, 3])
    temperature: float = bounded(1.0, gt=0)
    normalize: bool = False
    refresh: bool = True

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings."""
        out = []
        if not self.capacities or any(c < 1 for c in self.capacities):
            out.append(f"capacities: got {self.capacities}; expected a list of integers >= 1")
        return out


def block_probabilities(importance: list[float], capacity: int, temperature: float = 1.0,
                        normalize: bool = False) -> list[float]:
    """Probability of each contiguous block of ``capacity`` layers (LEFF stage 2):
    ``softmax(block importance / temperature)``, block importance = the sum of its layers'.

    Args:
        importance: One non-negative number per layer.
        capacity: Block length (clipped to the number of layers).
        temperature: Softmax temperature (1: the paper's softmax).
        normalize: Divide by the sum of all layers' importances first.

    Returns:
        One probability per block start ``0 .. len(importance) - capacity``.
    """
    n = len(importance)
    c = min(max(capacity, 1), n)
    total = (sum(importance) or 1.0) if normalize else 1.0
    scores = [sum(importance[s:s + c]) / total / temperature for s in range(n - c + 1)]
    top = max(scores)
    ex = [math.exp(v - top) for v in scores]
    z = sum(ex)
    return [e / z for e in ex]


def layer_importance(model: nn.Module, task: Task, data: Any, batch_size: int, seed: int) -> list[float]:
    """First-order Taylor importance ``sum |g * theta|`` per block (Molchanov et al. 2019).

    Computed over *all* parameters of each block (base weights included) on one batch (step 0
    of ``batch_indices`` under ``seed``), with the task's mean loss; the model's
    ``requires_grad`` flags are restored afterwards.

    Args:
        model: The client's model.
        task: The run's task (collation and loss).
        data: The client's examples (indexable, with ``pad_id``).
        batch_size: Examples in the batch (capped at ``len(data)``).
        seed: Seed of the batch draw.

    Returns:
        One number per block index ``0 .. max index`` (empty for a model without blocks).
    """
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(True)
    device = next(model.parameters()).device
    idx = batch_indices(0, len(data), min(batch_size, len(data)), seed)
    batch = {k: v.to(device) for k, v in task.collate([data[i] for i in idx], data.pad_id).items()}
    model.zero_grad(set_to_none=True)
    task.mean_loss(model, batch).backward()
    scores: dict[int, float] = {}
    for n, p in model.named_parameters():
        i = layer_index(n)
        if i is not None and p.grad is not None:
            scores[i] = scores.get(i, 0.0) + float((p.grad * p.detach()).abs().sum())
    model.zero_grad(set_to_none=True)
    for n, p in model.named_parameters():
        p.requires_grad_(flags[n])
    return [scores.get(i, 0.0) for i in range(max(scores) + 1)] if scores else []


def client_importance(client: Any) -> list[float]:
    """:func:`layer_importance` of a ClientApp's client on its own data (seed ``7 + partition``)."""
    return layer_importance(client.model, client.task, client.train_data, client.batch_size,
                            7 + client.partition_id)


def _timed_importance(client: Any) -> dict[str, Any]:
    """``{IMPORTANCE: per-layer importance, IMPORTANCE_S: seconds it took}``."""
    start = time.perf_counter()
    imp = client_importance(client)
    return {keys.IMPORTANCE: imp, keys.IMPORTANCE_S: round(time.perf_counter() - start, 4)}


class Leff(AdapterStrategy):
    """LEFF (Shen et al. 2025), per round: (1) each client declares its capacity L_i (a query
    message on first contact); (2) the server samples one block of L_i consecutive layers with
    probability softmax(block importance), importance = sum over a layer's parameters of the
    first-order Taylor term ``|g * theta|`` (Molchanov et al. 2019) of the *global* model,
    computed by the client on one local batch when it is first contacted and, in every round it
    trains, on the global model it received before training (used for its next plan); (4) the
    client trains only that block (plus the task head) and sends it; each layer is averaged over
    the clients that trained it, layers nobody trained keep their value.

    Choices: the trained tensors are whatever the run's method trains (LoRA factors, or the
    full weights with ``method: full``, the paper's setting); the paper counts the importance
    computation as server load, but the server here has no labelled data (the clients' stays
    local, and the public proxy set the paper's server would use belongs to stage 3, not
    built), so each client computes it on the global model with its own batch. Its cost,
    stated because it is what LEFF exists to avoid: one forward and one backward through the
    *whole* model with gradients for *all* base weights (a full-parameter step's compute and
    gradient memory, besides the block's local steps), every round (``refresh: false``: once
    per client); the seconds it took are logged per client and round (``importance_s`` in
    ``rounds.jsonl``), as are each client's block probabilities (``block_probabilities``). The
    plain softmax of raw ``sum |g theta|`` grows with parameters per layer, so the choice is
    close to deterministic on larger models (logged, not changed: it is the paper's rule as
    read). Stage 3 (distilling the untrained layers
    into a smaller frozen student on a public proxy set) is not implemented: clients run the
    frozen layers as they are, which removes the approximation error Delta^2 of the paper's
    bound and costs the clients the full frozen forward; what the distillation would cost in
    accuracy is not measured here.
    """

    name = "leff"

    @classmethod
    def pre_train_metrics(cls, client: Any, config: Mapping[str, Any]) -> dict[str, Any]:
        """A block round's reply refreshes the per-layer importance, measured on the global
        model the client received (before its local training changes it); not when the plan
        says ``refresh: false``."""
        if not config.get(keys.TRAIN_LAYERS) or not config.get(keys.REFRESH, True):
            return {}
        return _timed_importance(client)

    @classmethod
    def answer_query(cls, client: Any, config: Mapping[str, Any],
                     node_config: Mapping[str, Any]) -> dict[str, Any]:
        """Stage 1: capacity (``node_config["capacity"]`` when the SuperNode sets it, else the
        ``capacities`` list sent with the query, indexed by partition id) and importance."""
        caps = list(config.get(keys.CAPACITIES, [1]))
        cap = int(node_config.get(keys.CAPACITY, caps[client.partition_id % len(caps)]))
        return {keys.CAPACITY: cap, **_timed_importance(client)}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.layers = sorted({i for k in self.global_state if (i := layer_index(k)) is not None})
        self.capacity: dict[int, int] = {}
        self.importance: dict[int, list[float]] = {}
        self.blocks: dict[int, list[int]] = {}  # last block per node (for the log)
        self.probabilities: dict[int, list[float]] = {}  # the distribution it was drawn from
        self.seconds: dict[int, float] = {}     # last importance pass per node (client-timed)

    def configure_train(self, server_round: int, arrays, config, grid):
        """Query unknown nodes for capacity and importance, then send plans (see base class)."""
        self._query_new_nodes(grid)
        return super().configure_train(server_round, arrays, config, grid)

    def _query_new_nodes(self, grid) -> None:
        new = [n for n in grid.get_node_ids() if n not in self.capacity]
        if not new:
            return
        for reply in self.query(grid, new, {keys.CAPACITIES: list(self.config.capacities)}):
            if not reply.has_error():
                self._read_report(reply.metadata.src_node_id, dict(reply.content.metric_records[keys.METRICS]))

    def _read_report(self, node: int, metrics: dict) -> None:
        if keys.CAPACITY in metrics:
            self.capacity[node] = int(metrics[keys.CAPACITY])
        imp = metrics.get(keys.IMPORTANCE)
        if isinstance(imp, list) and imp:
            self.importance[node] = [float(v) for v in imp]
        if keys.IMPORTANCE_S in metrics:
            self.seconds[node] = float(metrics[keys.IMPORTANCE_S])
        if keys.PARTITION in metrics:
            self.partition_of[node] = int(metrics[keys.PARTITION])

    def plan(self, server_round: int, node_id: int) -> Plan:
        """Sample a block of the node's capacity by importance."""
        cap = self.capacity.get(node_id, self.config.capacities[0])
        imp_all = self.importance.get(node_id)
        imp = [imp_all[i] if imp_all and i < len(imp_all) else 1.0 for i in self.layers]
        probs = block_probabilities(imp, cap, self.config.temperature, self.config.normalize)
        start = self._rng.choices(range(len(probs)), weights=probs)[0]
        block = self.layers[start:start + min(cap, len(self.layers))]
        self.blocks[node_id] = block
        self.probabilities[node_id] = [round(p, 6) for p in probs]
        return Plan(factors="AB", layers=block, extra={keys.REFRESH: bool(self.config.refresh)})

    def aggregate_train(self, server_round: int, replies):
        """Base aggregation, plus reading refreshed importances and logging the blocks."""
        replies = list(replies)
        for r in replies:
            if not r.has_error() and keys.METRICS in r.content.metric_records:
                self._read_report(r.metadata.src_node_id, dict(r.content.metric_records[keys.METRICS]))
        out = super().aggregate_train(server_round, replies)
        entry = self.history[-1]
        nodes = [n for n in sorted(self.blocks, key=self._order) if n in self._expected]
        name = lambda n: f"partition {self.partition_of.get(n, '?')}"  # node ids vary per run
        entry["blocks"] = {name(n): self.blocks[n] for n in nodes}
        entry["block_probabilities"] = {name(n): self.probabilities[n] for n in nodes}
        entry["importance_s"] = {name(n): self.seconds[n] for n in nodes if n in self.seconds}
        return out

    def aggregate_updates(self, server_round: int, updates: list[Update]) -> list[str]:
        """Each key averaged over the clients that trained it; others unchanged."""
        new = average_present(updates)
        self.global_state.update(new)
        return list(new)
