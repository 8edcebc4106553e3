"""PubSub-VFL (Liu et al., "PubSub-VFL: Towards Efficient Two-Party Split Learning in
Heterogeneous Environments via Publisher/Subscriber Architecture", NeurIPS 2025,
arXiv:2510.12494): the hierarchical asynchronous mechanism and the profile-based configuration.

Inter-party asynchrony (Pub/Sub). The passive party's workers publish embeddings keyed by
batch id into a bounded embedding channel ``C_e`` (a full channel blocks the publisher:
back-pressure); the active party's workers subscribe to it, take whichever batch is ready,
compute the loss and publish ``dL/dz_p`` into the gradient channel ``C_g`` keyed by the same
batch id, where the passive worker that published the batch picks it up. Neither party waits
for the other's step to end, only for the data of its own batch.

Intra-party asynchrony (parameter server). Each party runs W worker threads that share one
parameter server (its model and SGD optimizer): a worker pulls the parameters and their
version, computes on its own replica, and pushes the gradient. Bounded staleness (our reading;
the paper's exact rule was not found, see docs/vfl.md): a push whose pulled version is more
than tau updates behind the server's is dropped and counted; otherwise it is applied as
computed (plain asynchronous SGD: the gradient at the stale parameters updates the current ones).

With W = 1 per party and tau = 0 every push is fresh and the schedule is the synchronous one,
step for step: the run equals ``sync.train_sync`` exactly (tested).

Why not Flower here: a Flower ClientApp is invoked once per message and must reply to it; a
worker that runs for the whole training and streams embeddings to subscribers while gradients
stream back has no place in that request/response model. The channels are therefore
in-process bounded buffers between threads; Flower drives the synchronous baseline.
"""
from __future__ import annotations

import collections
import copy
import itertools
import math
import threading
import time

import torch
import torch.nn.functional as F

from rankwise.federated.vfl.config import VFLConfig
from rankwise.federated.vfl.parties import (Stretch, Traffic, VFLData, accuracy, batch_order,
                                            stretch_of)


class ParameterServer:
    """One party's shared parameters, optimizer and version counter (thread-safe)."""

    def __init__(self, model: torch.nn.Module, lr: float, momentum: float, staleness: int) -> None:
        self.model, self.staleness = model, staleness
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        self.version = self.applied = self.dropped = 0
        self.stale_seen: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def pull(self, replica: torch.nn.Module) -> int:
        """Copy the current parameters into ``replica``; returns their version."""
        with self._lock, torch.no_grad():
            for r, p in zip(replica.parameters(), self.model.parameters()):
                r.copy_(p)
            return self.version

    def push(self, replica: torch.nn.Module, version: int) -> bool:
        """Apply ``replica``'s gradients computed at ``version`` unless more than tau updates
        stale; returns whether they were applied."""
        with self._lock:
            stale = self.version - version
            self.stale_seen[stale] += 1
            if stale > self.staleness:
                self.dropped += 1
                return False
            for r, p in zip(replica.parameters(), self.model.parameters()):
                p.grad = None if r.grad is None else r.grad.clone()
            self.opt.step()
            self.version += 1
            self.applied += 1
            return True


class Channel:
    """A bounded topic of ``(key, payload, ready_at)``: FIFO subscription (embeddings) or
    pick-up by key (gradients); ``ready_at`` models the crossing's latency."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.items: collections.OrderedDict = collections.OrderedDict()
        self.closed = False
        self._cond = threading.Condition()

    def publish(self, key: int, payload, latency_s: float = 0.0) -> None:
        """Add an item; blocks while the channel is full."""
        with self._cond:
            while self.capacity is not None and len(self.items) >= self.capacity:
                self._cond.wait()
            self.items[key] = (payload, time.perf_counter() + latency_s)
            self._cond.notify_all()

    def _wait_ready(self, item):
        payload, ready_at = item
        delay = ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return payload

    def subscribe(self):
        """The oldest item as ``(key, payload)``; ``None`` once closed and empty."""
        with self._cond:
            while not self.items and not self.closed:
                self._cond.wait()
            if not self.items:
                return None
            key, item = self.items.popitem(last=False)
            self._cond.notify_all()
        return key, self._wait_ready(item)

    def take(self, key: int):
        """The payload published under ``key`` (waits for it)."""
        with self._cond:
            while key not in self.items:
                self._cond.wait()
            item = self.items.pop(key)
            self._cond.notify_all()
        return self._wait_ready(item)

    def close(self) -> None:
        """No more items will be published; subscribers end when it is empty."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class _PubSubRun:
    """The shared state of one :func:`train_pubsub` run and its worker loops."""

    def __init__(self, cfg: VFLConfig, data: VFLData, passive_model, active_model) -> None:
        self.cfg, self.data = cfg, data
        self.passive_model, self.active_model = passive_model, active_model
        self.traffic, self.latency = Traffic(), cfg.latency_ms / 1e3
        self.ps_p = ParameterServer(passive_model, cfg.lr, cfg.momentum, cfg.staleness)
        self.ps_a = ParameterServer(active_model, cfg.lr, cfg.momentum, cfg.staleness)
        self.emb, self.grads = Channel(cfg.buffer), Channel()
        self.order = batch_order(len(data.y), cfg.batch_size, cfg.epochs, cfg.seed)
        self.per_epoch = len(self.order) // cfg.epochs
        self.batches = iter(enumerate(self.order))
        self.take_lock, self.done_lock = threading.Lock(), threading.Lock()
        self.losses, self.curve, self.done = {}, [], itertools.count(1)
        self.slow_p, self.slow_a = stretch_of(cfg, "passive"), stretch_of(cfg, "active")
        self.errors: list[BaseException] = []
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def evaluate(self, consumed: int) -> None:
        """Test accuracy on a snapshot of both parameter servers, appended to the curve."""
        data = self.data
        p_eval, a_eval = copy.deepcopy(self.passive_model), copy.deepcopy(self.active_model)
        self.ps_p.pull(p_eval)
        self.ps_a.pull(a_eval)
        with torch.no_grad():
            z = p_eval(data.x_passive_test)
            self.traffic.add("eval_embeddings", z)
            acc = accuracy(a_eval(z, data.x_active_test), data.y_test)
        self.curve.append({"epoch": consumed // self.per_epoch, "step": consumed, "accuracy": acc,
                           "wall_s": time.perf_counter() - self.t0,
                           "cpu_s": time.process_time() - self.c0})

    def passive_worker(self) -> None:
        """Take batches, publish their embeddings, back-propagate the returned gradients."""
        data, replica = self.data, copy.deepcopy(self.passive_model)
        while True:
            with self.take_lock:
                nxt = next(self.batches, None)
            if nxt is None:
                return
            step, ids = nxt
            version = self.ps_p.pull(replica)
            with Stretch(self.slow_p):
                replica.zero_grad()
                z = replica(data.x_passive[ids])  # (B, e)
            self.traffic.add("ids", ids)
            self.traffic.add("embeddings", z)
            self.emb.publish(step, (ids, z.detach()), self.latency)
            g = self.grads.take(step)
            with Stretch(self.slow_p):
                z.backward(g)
            self.ps_p.push(replica, version)
            with self.done_lock:  # the batch's round trip is over: both parties have pushed it
                finished = next(self.done)
                if finished % self.per_epoch == 0:
                    self.evaluate(finished)

    def active_worker(self) -> None:
        """Subscribe to embeddings, compute the loss, publish ``dL/dz_p`` by batch id."""
        data, replica = self.data, copy.deepcopy(self.active_model)
        while True:
            item = self.emb.subscribe()
            if item is None:
                return
            step, (ids, z_p) = item
            version = self.ps_a.pull(replica)
            z = z_p.clone().requires_grad_(True)
            with Stretch(self.slow_a):
                replica.zero_grad()
                loss = F.cross_entropy(replica(z, data.x_active[ids]), data.y[ids])
                loss.backward()
            self.ps_a.push(replica, version)  # before publishing, as the synchronous step does
            self.traffic.add("gradients", z.grad)
            self.grads.publish(step, z.grad, self.latency)
            self.losses[step] = float(loss.detach())

    def guard(self, fn):
        """``fn`` recording its exception (re-raised by :meth:`run`) and closing the channel."""
        def run():
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller
                self.errors.append(err)
                self.emb.close()
        return run

    def run(self) -> None:
        """Start every worker thread and wait for all; re-raise a worker's first error."""
        cfg = self.cfg
        passive = [threading.Thread(target=self.guard(self.passive_worker), daemon=True)
                   for _ in range(cfg.workers_passive)]
        active = [threading.Thread(target=self.guard(self.active_worker), daemon=True)
                  for _ in range(cfg.workers_active)]
        for t in passive + active:
            t.start()
        for t in passive:
            t.join()
        self.emb.close()
        for t in active:
            t.join()
        if self.errors:
            raise self.errors[0]

    def result(self) -> dict:
        """The return value of :func:`train_pubsub`."""
        ps_p, ps_a, losses, order = self.ps_p, self.ps_a, self.losses, self.order
        return {"curve": sorted(self.curve, key=lambda r: r["step"]),
                "losses": [losses[s] for s in sorted(losses)],
                "traffic": dict(self.traffic.bytes), "messages": dict(self.traffic.messages),
                "steps": len(order), "batch_sizes": [len(i) for i in order],
                "dropped": ps_p.dropped + ps_a.dropped,
                "dropped_passive": ps_p.dropped, "dropped_active": ps_a.dropped,
                "staleness_passive": dict(sorted(ps_p.stale_seen.items())),
                "staleness_active": dict(sorted(ps_a.stale_seen.items())),
                "wall_s": time.perf_counter() - self.t0, "cpu_s": time.process_time() - self.c0}


def train_pubsub(cfg: VFLConfig, data: VFLData, passive_model, active_model) -> dict:
    """PubSub-VFL for ``cfg.epochs`` epochs; test accuracy after every epoch's worth of
    finished batches (a batch is finished when the passive worker has pushed it, after the
    active worker pushed its own update), on a snapshot of both parameter servers. Same return keys as ``train_sync``,
    plus the staleness histograms and the dropped pushes per party."""
    run = _PubSubRun(cfg, data, passive_model, active_model)
    run.run()
    return run.result()


def profile(cfg: VFLConfig, data: VFLData, passive_model, active_model, batch: int, reps: int = 20) -> dict:
    """A party's system profile at one batch size: seconds per batch of its compute (forward +
    backward, its slowdown included) and per-batch payload bytes. Only these numbers leave a
    party, never rows or parameters."""
    p, a = copy.deepcopy(passive_model), copy.deepcopy(active_model)
    ids = torch.arange(min(batch, len(data.y)))
    times = {}
    for party, fn, slow in (
            ("passive", lambda: p(data.x_passive[ids]).sum().backward(), stretch_of(cfg, "passive")),
            ("active", lambda: F.cross_entropy(a(torch.zeros(len(ids), cfg.embed, requires_grad=True),
                                                 data.x_active[ids]), data.y[ids]).backward(),
             stretch_of(cfg, "active"))):
        fn()  # warm-up
        t = time.perf_counter()
        for _ in range(reps):
            with Stretch(slow):
                fn()
        times[party] = (time.perf_counter() - t) / reps
    return {"batch": batch, "t_passive": times["passive"], "t_active": times["active"],
            "bytes_per_batch": 2 * len(ids) * cfg.embed * 4}


def predicted_epoch_s(prof: dict, n: int, w_p: int, w_a: int, cores: tuple[int, int], latency_s: float) -> float:
    """Predicted seconds per epoch: the pipeline runs at its slowest stage, where a party with W
    workers on c cores serves min(W, c) batches at once, and a passive worker holds its batch
    for a whole round trip (its compute, the active compute, two crossings)."""
    t_p, t_a = prof["t_passive"], prof["t_active"]
    rate = min(min(w_p, cores[0]) / t_p, min(w_a, cores[1]) / t_a, w_p / (t_p + t_a + 2 * latency_s))
    return math.ceil(n / prof["batch"]) / rate


def choose_config(cfg: VFLConfig, data: VFLData, passive_model, active_model) -> dict:
    """PubSub-VFL's configuration from system profiles (our reading of the paper's
    optimisation, solved by exhaustive search over the small grid instead of its dynamic
    programme): batch size B from ``cfg.batch_sizes`` and workers ``W_p, W_a <= max_workers``
    minimising the predicted epoch time; ties within 5% go to fewer workers, then the smaller
    batch. Staleness bound tau = max(W_p, W_a); buffer = 2 * W_p.

    Returns:
        ``{"batch_size", "workers_passive", "workers_active", "staleness", "buffer",
        "predicted_epoch_s", "profiles"}``.
    """
    profiles = [profile(cfg, data, passive_model, active_model, b) for b in cfg.batch_sizes]
    cores, n = cfg.core_counts(), len(data.y)
    cands = []
    for prof in profiles:
        for w_p in range(1, cfg.max_workers + 1):
            for w_a in range(1, cfg.max_workers + 1):
                cands.append((predicted_epoch_s(prof, n, w_p, w_a, cores, cfg.latency_ms / 1e3),
                              w_p + w_a, prof["batch"], w_p, w_a))
    best_t = min(c[0] for c in cands)
    t, _, b, w_p, w_a = min((c for c in cands if c[0] <= 1.05 * best_t), key=lambda c: (c[1], c[2]))
    return {"batch_size": b, "workers_passive": w_p, "workers_active": w_a, "staleness": max(w_p, w_a),
            "buffer": 2 * w_p, "predicted_epoch_s": t, "profiles": profiles}
