"""The round lifecycle shared by every rankwise strategy (a Flower ``Strategy``).

One round: sample nodes -> send each a *plan* (which factors/layers train) and the global
tensors it does not hold yet -> receive updates -> reject malformed ones -> aggregate the
rest (method-specific hook) -> log bytes, who failed, who was rejected. Evaluation is central
(the ServerApp evaluates the global adapter), so ``configure_evaluate`` sends nothing.

Download rule (all methods): a node receives a global tensor only if its value changed since
that node last received it, or the node trained it locally since (its copy diverged). Nodes
keep their adapter across rounds (``Context.state``), so this is exactly what they need.
Clients build the initial adapter from the run's seed, as the server does, so nothing is sent
for it; on first contact the server sends a fingerprint of it and the client refuses to train
if its own differs. A client that lost its copy (``sync-round`` mismatch) answers with an
error marked ``rankwise-resync`` and gets every tensor next time it is sampled.
"""
from __future__ import annotations

import copy
import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from rankwise.federated import keys
from rankwise.federated.config import FederatedConfig
from rankwise.federated.payload import (from_record, record_bytes, select_keys, to_record,
                                        validate_update)
from rankwise.federated.strategies.client_hooks import ClientHooks

LOG = logging.getLogger("rankwise.federated")

try:  # flwr is optional for the rest of rankwise; strategies need it
    from flwr.serverapp.strategy import Strategy as _FlowerStrategy
except ImportError:  # pragma: no cover - exercised only without flwr
    _FlowerStrategy = object


@dataclass
class Plan:
    """What one node does in one round.

    Attributes:
        factors: Low-rank factors that train (``"AB"``, ``"A"``, ``"B"``; which tensor is
            which comes from the strategy's ``roles``, found through the adapter protocol).
        layers: Block indices that train; empty means all.
        phase: ``"train"``, ``"warmup"`` or ``"oneshot"``.
        extra: More ConfigRecord entries (e.g. a FedLEASE cluster id).
    """

    factors: str = "AB"
    layers: list[int] = field(default_factory=list)
    phase: str = "train"
    extra: dict = field(default_factory=dict)


@dataclass
class Update:
    """One accepted client update.

    Attributes:
        node_id: Flower node id of the sender.
        state: The tensors it sent.
        weight: Its number of examples.
        metrics: Everything else it reported.
    """

    node_id: int
    state: dict[str, torch.Tensor]
    weight: float
    metrics: dict


class AdapterStrategy(ClientHooks, _FlowerStrategy):
    """Base class: FedAvg's round lifecycle (McMahan et al. 2017, Alg. 1) over adapter tensors.

    Server-side hooks (instance methods): :meth:`plan` and :meth:`aggregate_updates`; for
    multi-model methods :meth:`payload_keys`, :meth:`expected`, :meth:`eval_views` and
    :meth:`eval_model`; :meth:`num_rounds`; :meth:`run_metrics`. Client-side hooks are class
    methods inherited from :class:`~rankwise.federated.strategies.client_hooks.ClientHooks`
    (``needs_factors``, ``model_structure``, ``prepare_model``, ``wire_parameters``,
    ``train_names``, ``loss_hooks``, ``client_metrics``, ``answer_query``).

    Args:
        config: The strategy's own config dataclass.
        fed: The run's federated settings.
        initial: The initial global tensors ``{name: tensor}`` (same on every client).
        train_config: Extra ConfigRecord entries sent every round (steps, learning rate).
        roles: ``{name: "A" | "B"}`` of the low-rank factors among ``initial``, found through
            the adapter protocol (:func:`rankwise.federated.wire.factor_roles` of the server's
            model); other names are no factors.

    Raises:
        ValueError: If the strategy ``needs_factors`` and ``roles`` names none of ``initial``.
    """

    name = "base"
    round_offset = 0  # rounds completed before this federation started (a resumed run)

    def __init__(self, config, fed: FederatedConfig, initial: dict[str, torch.Tensor],
                 train_config: dict | None = None, roles: Mapping[str, str] | None = None) -> None:
        self.roles = {k: v for k, v in (roles or {}).items() if k in initial}
        if self.needs_factors and not self.roles:
            raise ValueError(f"strategy {self.name!r} acts on low-rank factors but roles names none "
                             "of the initial tensors; pass roles=factor_roles(model)")
        self.config, self.fed = config, fed
        self.global_state = {k: v.detach().float().clone() for k, v in initial.items()}
        self.train_config = dict(train_config or {})
        self.history: list[dict] = []          # one entry per round (rounds.jsonl)
        self.partition_of: dict[int, int] = {}  # node id -> data partition
        self._version = {k: 0 for k in self.global_state}  # round a key last changed
        self._held: dict[int, dict[str, int]] = {}  # node -> key -> version it holds (-1 stale)
        self._last_sent: dict[int, int] = {}  # node -> round of its last payload
        self._full_sync: set[int] = set()  # nodes that lost their copy
        self.fingerprint = fingerprint(self.global_state)
        self._expected: dict[int, dict[str, tuple]] = {}
        self._bytes_down = 0
        self._control = [0, 0]  # bytes down/up of query messages since the last round's entry
        self._rng = random.Random(fed.seed)

    # ----- hooks ---------------------------------------------------------------------------
    @classmethod
    def initial_tensors(cls, model: nn.Module, state: dict[str, torch.Tensor],
                        roles: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """The initial adapter, from a freshly prepared ``model`` and its trainable tensors
        ``state`` (default: ``state`` as prepared; YOCO builds B from the SVD of the base
        weights). :func:`rankwise.federated.task.build_session` applies it on the server and on
        every client, so both hold the same initial adapter without sending it."""
        return state

    def plan(self, server_round: int, node_id: int) -> Plan:
        """The plan of ``node_id`` in ``server_round`` (default: train everything)."""
        return Plan()

    def payload_keys(self, node_id: int, plan: Plan) -> list[str]:
        """Global keys a node may need this round (default: all); filtered by version."""
        return list(self.global_state)

    def expected(self, node_id: int, plan: Plan) -> dict[str, tuple]:
        """``{name: shape}`` the node must send back (default: :func:`select_keys` of the plan)."""
        names = select_keys(self.global_state, self.roles, plan.factors, plan.layers)
        return {n: tuple(self.global_state[n].shape) for n in names}

    def aggregate_updates(self, server_round: int, updates: list[Update]) -> list[str]:
        """Fold accepted updates into ``self.global_state``; return the keys that changed."""
        raise NotImplementedError

    def eval_views(self) -> list[tuple[dict[str, torch.Tensor], dict, set[int] | None]]:
        """Models to evaluate: ``(tensors, config entries, partitions or None = all data)``."""
        return [(self.global_state, {}, None)]

    def eval_model(self, model: nn.Module, extra: Mapping[str, Any]) -> nn.Module:
        """The model a view with config entries ``extra`` is evaluated on: ``model`` itself, or
        a copy restructured by :meth:`prepare_model` when :meth:`model_structure` of ``extra``
        is not empty (the server's model stays plain)."""
        if not self.model_structure(extra):
            return model
        model = copy.deepcopy(model)
        self.prepare_model(model, extra)
        return model

    def num_rounds(self, requested: int) -> int:
        """Rounds this strategy runs when the user asks for ``requested``."""
        return requested

    def run_metrics(self) -> dict[str, Any]:
        """Strategy-specific entries of the run's ``metrics.json`` (default none)."""
        return {}

    def extra_state(self) -> dict[str, Any]:
        """The strategy's own JSON state for a round checkpoint (default none); node-keyed
        entries must be keyed by data partition (node ids change between federations)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`extra_state` returned (default: nothing to restore)."""

    # ----- round checkpoints ------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(global tensors, JSON state)`` of a round checkpoint (``federated/checkpoint.py``):
        the round history, the round each key last changed, the sampling RNG, the strategy's
        :meth:`extra_state`."""
        version, internal, gauss = self._rng.getstate()
        return dict(self.global_state), {
            "history": self.history, "version": self._version,
            "rng": [version, list(internal), gauss], "extra": self.extra_state()}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; nodes start without a copy of the adapter
        (they get every key changed since the start, as new nodes do)."""
        self.global_state = {k: v.float().clone() for k, v in tensors.items()}
        self.history = list(state["history"])
        self._version = {k: int(v) for k, v in state["version"].items()}
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self.load_extra_state(state.get("extra") or {})

    # ----- Flower Strategy API -----------------------------------------------------------------
    def summary(self) -> None:
        """Log the configuration."""
        LOG.info("rankwise strategy %s: %s; %s", self.name, self.config, self.fed)

    def _sample(self, grid) -> list[int]:
        """Draw ``max(fraction * n, min_clients)`` of the connected nodes (seeded), in partition
        order (see :meth:`connected`)."""
        everyone = self.connected(grid)
        size = min(max(int(len(everyone) * self.fed.fraction), self.fed.min_clients), len(everyone))
        return sorted(self._rng.sample(everyone, size), key=self._order)

    def connected(self, grid) -> list[int]:
        """Wait for ``min_clients`` nodes; return the connected ones ordered by data partition.

        Simulation node ids are random per run, so sampling, the order of plans (LEFF draws a
        block per node) and the order of sums follow the partition each node reports (an
        ``identify`` query on first contact), never the node id: reruns reproduce exactly.
        """
        from flwr.serverapp.strategy.strategy_utils import sample_nodes
        _, everyone = sample_nodes(grid, self.fed.min_clients, self.fed.min_clients)
        new = [n for n in everyone if n not in self.partition_of]
        if new:
            for r in self.query(grid, new, {keys.PHASE: keys.IDENTIFY}):
                if not r.has_error() and keys.METRICS in r.content.metric_records:
                    self.partition_of[r.metadata.src_node_id] = int(
                        r.content.metric_records[keys.METRICS][keys.PARTITION])
        return sorted(everyone, key=self._order)

    def _order(self, node: int) -> tuple[float, int]:
        """Sort key of a node: its partition id (unknown: last), then its node id."""
        return (self.partition_of.get(node, math.inf), node)

    def query(self, grid, nodes: list[int], config: dict) -> list:
        """Send a Flower ``query`` message with ``config`` to ``nodes``; return the replies.

        Their bytes (both ways) are added to the next round's entry of ``history``.
        """
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict
        msgs = [Message(RecordDict({keys.CONFIG: ConfigRecord(dict(config))}),
                        message_type=MessageType.QUERY, dst_node_id=n) for n in nodes]
        self._control[0] += sum(record_bytes(m.content) for m in msgs)
        replies = list(grid.send_and_receive(msgs, timeout=self.fed.round_timeout))
        for r in replies:
            if r.has_error():
                LOG.warning("query: %s failed: %s", self.who(r.metadata.src_node_id),
                            _last_line(r.error.reason))
            else:
                self._control[1] += record_bytes(r.content)
        return replies

    def who(self, node: int) -> str:
        """``"node 123 (partition 2)"`` for logs (partition once the node has reported it)."""
        part = self.partition_of.get(node)
        return f"node {node}" + ("" if part is None else f" (partition {part})")

    def configure_train(self, server_round: int, arrays, config, grid) -> Iterable:
        """Send each sampled node its plan and the global tensors it lacks.

        Args:
            server_round: Flower's round number, from 1 (``round_offset`` is added: a resumed
                run's rounds continue its numbering, and with it the clients' seeds).
            arrays: Ignored: the global state lives in the strategy (it is not one record
                for every method).
            config: Flower's train ConfigRecord (entries are forwarded).
            grid: The Flower Grid.

        Returns:
            One ``Message`` per sampled node.
        """
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict
        server_round += self.round_offset
        self._expected, self._bytes_down = {}, 0
        messages = []
        for node in self._sample(grid):
            plan = self.plan(server_round, node)
            full = node in self._full_sync
            if full:
                self._held[node] = {}
            held = self._held.setdefault(node, {k: 0 for k, v in self._version.items() if v == 0})
            send = [k for k in self.payload_keys(node, plan) if held.get(k) != self._version[k]]
            cfg = {**dict(config), **self.train_config, keys.ROUND: server_round,
                   keys.TRAIN_FACTORS: plan.factors, keys.TRAIN_LAYERS: list(plan.layers),
                   keys.PHASE: plan.phase, keys.SYNC_ROUND: self._last_sent.get(node, 0),
                   keys.FULL_SYNC: full, **plan.extra}
            if node not in self._last_sent:
                cfg[keys.INIT_FINGERPRINT] = self.fingerprint
            self._last_sent[node] = server_round
            self._full_sync.discard(node)
            content = RecordDict({keys.ARRAYS: to_record({k: self.global_state[k] for k in send}),
                                  keys.CONFIG: ConfigRecord(cfg)})
            self._bytes_down += record_bytes(content)
            for k in send:
                held[k] = self._version[k]
            self._expected[node] = self.expected(node, plan)
            messages.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node))
        LOG.info("round %d: sent plans to nodes %s", server_round, sorted(self._expected))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable):
        """Validate replies, log failures, aggregate the accepted updates.

        Returns:
            ``(ArrayRecord of the global state, MetricRecord of round metrics)``.
        """
        from flwr.app import MetricRecord
        server_round += self.round_offset
        replies = list(replies)
        entry = {"round": server_round, "sampled": len(self._expected),
                 "bytes_down": self._bytes_down + self._control[0], "bytes_up": self._control[1],
                 "failed": [], "missing": [], "rejected": []}
        self._control = [0, 0]
        updates: list[Update] = []
        seen = set()
        for msg in replies:
            node = msg.metadata.src_node_id
            seen.add(node)
            if msg.has_error():
                LOG.warning("round %d: %s failed: %s", server_round, self.who(node),
                            _last_line(msg.error.reason))
                entry["failed"].append(node)
                if keys.RESYNC_REASON in str(msg.error.reason):
                    self._full_sync.add(node)
                continue
            entry["bytes_up"] += record_bytes(msg.content)
            update, problems = self._parse(msg, node)
            if problems:
                LOG.warning("round %d: rejected update of %s: %s", server_round, self.who(node),
                            "; ".join(problems))
                entry["rejected"].append(node)
                continue
            updates.append(update)
        for node in sorted(set(self._expected) - seen):
            LOG.warning("round %d: %s sent no reply (crashed, disconnected or timed out)",
                        server_round, self.who(node))
            entry["missing"].append(node)
        for node, exp in self._expected.items():  # their local copies of trained keys diverged
            for k in exp:
                if k in self._version:
                    self._held[node][k] = -1
        updates.sort(key=lambda u: self._order(u.node_id))  # sums in partition order, not arrival
        if len(updates) >= self.fed.min_clients:
            for k in self.aggregate_updates(server_round, updates):
                self._version[k] = server_round
            entry["aggregated"] = len(updates)
        else:
            LOG.warning("round %d: only %d valid updates (min_clients=%d); global adapter unchanged",
                        server_round, len(updates), self.fed.min_clients)
            entry["aggregated"] = 0
        total = sum(u.weight for u in updates)
        entry["train_loss"] = (sum(u.weight * u.metrics.get(keys.TRAIN_LOSS, 0.0) for u in updates)
                               / total) if total else None
        self.history.append(entry)
        metrics = {keys.BYTES_UP: entry["bytes_up"], keys.BYTES_DOWN: entry["bytes_down"],
                   keys.AGGREGATED: entry["aggregated"]}
        if entry["train_loss"] is not None:
            metrics[keys.TRAIN_LOSS] = entry["train_loss"]
        return to_record(self.global_state), MetricRecord(metrics)

    def _parse(self, msg, node: int) -> tuple[Update | None, list[str]]:
        content = msg.content
        if keys.ARRAYS not in content.array_records or keys.METRICS not in content.metric_records:
            return None, [f"reply lacks the {keys.ARRAYS!r} or {keys.METRICS!r} record"]
        metrics = dict(content.metric_records[keys.METRICS])
        weight = metrics.get(keys.NUM_EXAMPLES)
        if not isinstance(weight, (int, float)) or not weight > 0 or weight != weight:
            return None, [f"{keys.NUM_EXAMPLES!r} is {weight!r}; expected a positive number"]
        try:
            state = from_record(content.array_records[keys.ARRAYS])
        except Exception as err:  # noqa: BLE001 - any undecodable payload is a rejection
            return None, [f"undecodable arrays: {err}"]
        problems = validate_update(state, self._expected.get(node, {}))
        if keys.PARTITION in metrics:
            self.partition_of[node] = int(metrics[keys.PARTITION])
        return Update(node, state, float(weight), metrics), problems

    def configure_evaluate(self, server_round: int, arrays, config, grid) -> Iterable:
        """Evaluation is central (``evaluate_fn`` of the ServerApp): no messages."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable):
        """Nothing to aggregate (see :meth:`configure_evaluate`)."""
        return None


def _last_line(text) -> str:
    """The last non-empty line of an error text (a remote traceback's exception line)."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def fingerprint(state: dict[str, torch.Tensor]) -> str:
    """A short hash of tensors (names, shapes and float32 values)."""
    import hashlib
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
