"""Synchronous split learning, the baseline: every step waits for the other party.

Two engines run the same party code. ``flower``: the two parties are Flower ``ClientApp``s
(actions ``train.forward``, ``train.step``, ``train.backward``, ``query.embed``,
``query.evaluate``) and a ServerApp-style loop drives them with Flower ``Message``s through an
in-process grid, as ``federated/inprocess.py`` does for horizontal runs (no Ray; the
ClientApps are dispatched by Flower's own ``ClientApp.__call__``). ``direct``: the same calls
without messages, to show what Flower's messaging costs per step.

Flower's request/response model fits this baseline exactly (one request, one reply, in
lock-step); it does not fit PubSub-VFL's long-lived workers and channels (see ``pubsub.py``).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from rankwise.federated.vfl.config import VFLConfig
from rankwise.federated.vfl.parties import (Stretch, Traffic, VFLData, accuracy, batch_order,
                                            stretch_of)

PASSIVE_NODE, ACTIVE_NODE = 1, 2


class PassiveParty:
    """The passive party: its columns and bottom model; never sees a label."""

    def __init__(self, cfg: VFLConfig, model: torch.nn.Module, x: torch.Tensor, x_test: torch.Tensor) -> None:
        self.model, self.x, self.x_test = model, x, x_test
        self.opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        self.slow = stretch_of(cfg, "passive")
        self.pending: dict[int, torch.Tensor] = {}

    def forward(self, step: int, ids: torch.Tensor) -> torch.Tensor:
        """The embedding of rows ``ids`` (kept with its graph until :meth:`backward`)."""
        with Stretch(self.slow):
            z = self.model(self.x[ids])  # (B, e)
        self.pending[step] = z
        return z.detach()

    def backward(self, step: int, grad: torch.Tensor) -> None:
        """Back-propagate the received ``dL/dz_p`` and take an SGD step."""
        with Stretch(self.slow):  # the slowdown stretches forward/backward, as in pubsub.py
            self.opt.zero_grad()
            self.pending.pop(step).backward(grad)
        self.opt.step()

    @torch.no_grad()
    def embed_test(self) -> torch.Tensor:
        """Embeddings of the test rows (for the active party's evaluation)."""
        return self.model(self.x_test)


class ActiveParty:
    """The active party: its columns, bottom and top model, and the labels."""

    def __init__(self, cfg: VFLConfig, model: torch.nn.Module, data: VFLData) -> None:
        self.model, self.x, self.y = model, data.x_active, data.y
        self.x_test, self.y_test = data.x_active_test, data.y_test
        self.opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        self.slow = stretch_of(cfg, "active")

    def step(self, ids: torch.Tensor, z_passive: torch.Tensor) -> tuple[torch.Tensor, float]:
        """One step on rows ``ids``: returns ``(dL/dz_p, loss)`` after updating its own models."""
        z = z_passive.clone().requires_grad_(True)
        with Stretch(self.slow):
            self.opt.zero_grad()
            loss = F.cross_entropy(self.model(z, self.x[ids]), self.y[ids])
            loss.backward()
        self.opt.step()
        return z.grad, float(loss.detach())

    @torch.no_grad()
    def evaluate(self, z_test: torch.Tensor) -> float:
        """Test accuracy given the passive party's test embeddings."""
        return accuracy(self.model(z_test, self.x_test), self.y_test)


class Direct:
    """The parties called directly (no messages); counts what would cross."""

    def __init__(self, passive: PassiveParty, active: ActiveParty, traffic: Traffic, latency_s: float) -> None:
        self.passive, self.active, self.traffic, self.latency = passive, active, traffic, latency_s

    def _cross(self, kind: str, t: torch.Tensor) -> torch.Tensor:
        self.traffic.add(kind, t)
        if self.latency:
            time.sleep(self.latency)
        return t

    def forward(self, step, ids):
        self.traffic.add("ids", ids)
        return self._cross("embeddings", self.passive.forward(step, ids))

    def step(self, ids, z):
        grad, loss = self.active.step(ids, z)
        return self._cross("gradients", grad), loss

    def backward(self, step, grad):
        self.passive.backward(step, grad)

    def evaluate(self):
        return self.active.evaluate(self._cross("eval_embeddings", self.passive.embed_test()))


def client_apps(passive: PassiveParty, active: ActiveParty):
    """The two parties as Flower ClientApps (one action per split-learning call)."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    def arrays(**tensors):
        return ArrayRecord({k: Array(v.detach().cpu().numpy()) for k, v in tensors.items()})

    def tensor(msg, key):
        return torch.from_numpy(msg.content.array_records["a"][key].numpy().copy())

    def step_of(msg):
        return int(msg.content.metric_records["m"]["step"])

    papp, aapp = ClientApp(), ClientApp()

    @papp.train("forward")
    def forward(msg, context):
        z = passive.forward(step_of(msg), tensor(msg, "ids"))
        return Message(RecordDict({"a": arrays(embedding=z)}), reply_to=msg)

    @papp.train("backward")
    def backward(msg, context):
        passive.backward(step_of(msg), tensor(msg, "gradient"))
        return Message(RecordDict({"m": MetricRecord({"ok": 1})}), reply_to=msg)

    @papp.query("embed")
    def embed(msg, context):
        return Message(RecordDict({"a": arrays(embedding=passive.embed_test())}), reply_to=msg)

    @aapp.train("step")
    def step(msg, context):
        grad, loss = active.step(tensor(msg, "ids"), tensor(msg, "embedding"))
        return Message(RecordDict({"a": arrays(gradient=grad), "m": MetricRecord({"loss": loss})}), reply_to=msg)

    @aapp.query("evaluate")
    def evaluate(msg, context):
        acc = active.evaluate(tensor(msg, "embedding"))
        return Message(RecordDict({"m": MetricRecord({"accuracy": acc})}), reply_to=msg)

    return papp, aapp


class FlowerGrid:
    """The ServerApp side: sends Flower Messages to the two parties' ClientApps in this
    process and returns their replies; counts the embedding and gradient payloads that cross."""

    def __init__(self, passive: PassiveParty, active: ActiveParty, traffic: Traffic, latency_s: float) -> None:
        from flwr.app import Context, RecordDict
        from flwr.supercore.task_identity import TaskIdentity
        for name in ("run_id", "node_id", "task_id"):  # message ids need a task identity outside Flower
            if getattr(TaskIdentity, f"_{name}") is None:
                setattr(TaskIdentity, name, 0)
        self.apps = dict(zip((PASSIVE_NODE, ACTIVE_NODE), client_apps(passive, active)))
        self.contexts = {n: Context(run_id=1, node_id=n, state=RecordDict(), node_config={}, run_config={})
                         for n in self.apps}
        self.traffic, self.latency = traffic, latency_s

    def send(self, node: int, message_type: str, step: int = 0, **tensors):
        """One request/response with ``node``; returns the reply's content."""
        from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
        content = RecordDict({"m": MetricRecord({"step": step})})
        if tensors:
            content["a"] = ArrayRecord({k: Array(v.detach().cpu().numpy()) for k, v in tensors.items()})
        msg = Message(content, dst_node_id=node, message_type=message_type)
        reply = self.apps[node](msg, self.contexts[node])
        if reply.has_error():
            raise RuntimeError(f"party {node} failed on {message_type}: {reply.error.reason}")
        return reply.content

    def _take(self, content, key: str, kind: str) -> torch.Tensor:
        t = torch.from_numpy(content.array_records["a"][key].numpy().copy())
        self.traffic.add(kind, t)
        if self.latency:
            time.sleep(self.latency)
        return t

    def forward(self, step, ids):
        self.traffic.add("ids", ids)
        return self._take(self.send(PASSIVE_NODE, "train.forward", step, ids=ids), "embedding", "embeddings")

    def step(self, ids, z):
        reply = self.send(ACTIVE_NODE, "train.step", ids=ids, embedding=z)
        return self._take(reply, "gradient", "gradients"), float(reply.metric_records["m"]["loss"])

    def backward(self, step, grad):
        self.send(PASSIVE_NODE, "train.backward", step, gradient=grad)

    def evaluate(self):
        z = self._take(self.send(PASSIVE_NODE, "query.embed"), "embedding", "eval_embeddings")
        return float(self.send(ACTIVE_NODE, "query.evaluate", embedding=z).metric_records["m"]["accuracy"])


def train_sync(cfg: VFLConfig, data: VFLData, passive_model, active_model) -> dict:
    """Synchronous split learning for ``cfg.epochs`` epochs; test accuracy after every epoch.

    Returns:
        ``{"curve": [{epoch, step, wall_s, cpu_s, accuracy}], "losses", "traffic", "steps",
        "batch_sizes", "wall_s", "cpu_s"}``; times count the training loop only (not the
        parties' set-up, which for ``flower`` includes importing Flower).
    """
    traffic = Traffic()
    passive = PassiveParty(cfg, passive_model, data.x_passive, data.x_passive_test)
    active = ActiveParty(cfg, active_model, data)
    engine = (FlowerGrid if cfg.engine == "flower" else Direct)(passive, active, traffic, cfg.latency_ms / 1e3)
    order = batch_order(len(data.y), cfg.batch_size, cfg.epochs, cfg.seed)
    per_epoch = len(order) // cfg.epochs
    curve, losses = [], []
    t0, c0 = time.perf_counter(), time.process_time()
    for step, ids in enumerate(order):
        z = engine.forward(step, ids)
        grad, loss = engine.step(ids, z)
        engine.backward(step, grad)
        losses.append(loss)
        if (step + 1) % per_epoch == 0:
            curve.append({"epoch": (step + 1) // per_epoch, "step": step + 1, "accuracy": engine.evaluate(),
                          "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0})
    return {"curve": curve, "losses": losses, "traffic": dict(traffic.bytes), "messages": dict(traffic.messages),
            "steps": len(order), "batch_sizes": [len(i) for i in order], "dropped": 0,
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
