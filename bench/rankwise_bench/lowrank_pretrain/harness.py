"""One (row, learning rate) run of ``lowrank-pretrain``: model, optimizer, schedule, the
engine's step, and what is measured around it (losses, state bytes, step times, peak memory)."""
from __future__ import annotations

import contextlib
import copy
import math
import time
from typing import Any

import torch
from torch import nn

import rankwise
from rankwise.engine import Engine, NonFiniteLoss, evaluate, get_task
from rankwise.engine.precision import PRECISIONS
from rankwise.optim.common import state_bytes
from rankwise_bench.common import llama
from rankwise_bench.corpus import ByteWindows
from rankwise_bench.lowrank_pretrain.rows import ROWS, Sizes


def build_model(s: Sizes) -> nn.Module:
    """A Llama-style causal LM built from ``LlamaConfig`` with seeded random weights (float32
    master weights, created directly on ``s.device``; ``meta`` counts parameters for free)."""
    return llama(256, s.hidden, s.layers, s.heads, s.intermediate, positions=s.seq, seed=s.seed,
                 device=s.device, bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)


def prepared_model(name: str, s: Sizes) -> nn.Module:
    """:func:`build_model`, adapted by the row's method if it has one: the method's layers
    replace the targets, and every other parameter trains too (pre-training from scratch)."""
    model = build_model(s)
    method = ROWS[name].method
    if method is not None:
        frozen_before = {id(p) for p in model.parameters()}
        rankwise.apply(model, method["name"], **{"rank": s.rank, **{k: v for k, v in method.items() if k != "name"}})
        released = {id(p) for p in model.parameters() if p.stride() == (0, 0)}   # dense weights given up
        for p in model.parameters():
            if id(p) in frozen_before and id(p) not in released:
                p.requires_grad_(True)
    return model


def param_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameter storages (a released dense weight holds one element)."""
    return sum(p.untyped_storage().nbytes() for p in dict.fromkeys(model.parameters()))


def counted_state_bytes(opt: torch.optim.Optimizer) -> int:
    """State bytes from the tensors in ``opt.state`` (plus galore-torch's projector object)."""
    total = state_bytes(opt)
    for st in opt.state.values():
        proj = st.get("projector")
        if proj is not None and torch.is_tensor(getattr(proj, "ortho_matrix", None)):
            total += proj.ortho_matrix.numel() * proj.ortho_matrix.element_size()
    return total


def _autocast(s: Sizes):
    """The engine's autocast context factory for ``s.precision`` on ``s.device``."""
    dtype = PRECISIONS[s.precision]
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(s.device.split(":")[0], dtype=dtype)


def heldout_loss(model: nn.Module, heldout: ByteWindows, s: Sizes) -> float:
    """Mean next-byte cross-entropy (nats) over the held-out windows (the task's ``eval_loss``)."""
    return evaluate(model, get_task("causal-lm"), heldout, 16, s.device, _autocast(s))["eval_loss"]


def make_engine(name: str, lr: float, s: Sizes, train: ByteWindows) -> tuple[Engine, Any]:
    """A fresh model, the row's optimizer and schedule (10% warm-up, cosine to 10%), in an
    :class:`Engine`; and the optimizer config."""
    model = prepared_model(name, s)
    config = ROWS[name].config(lr, s)
    opt = ROWS[name].make(model, config)
    warm = max(1, s.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / warm if k < warm else
                                              0.1 + 0.45 * (1 + math.cos(math.pi * (k - warm) / (s.steps - warm))))
    engine = Engine(model, get_task("causal-lm"), opt, train, s.batch, seed=s.seed, scheduler=sched,
                    precision=s.precision, device=s.device)
    return engine, config


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _record_step_times(opt: torch.optim.Optimizer, device: str) -> list[float]:
    """Seconds of every ``opt.step`` call from now on, measured by the optimizer's step hooks
    (synchronizing a GPU first, so the time is the step's work, not its launch)."""
    times: list[float] = []
    began: list[float] = []

    def pre(*_):
        _sync(device)
        began.append(time.perf_counter())

    def post(*_):
        _sync(device)
        times.append(time.perf_counter() - began.pop())
    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    return times


def median(xs: list[float]) -> float:
    """The middle value (upper median), ``nan`` for an empty list."""
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def mean(xs: list[float]) -> float:
    """The mean, ``nan`` for an empty list."""
    return sum(xs) / len(xs) if xs else float("nan")


def train_one(name: str, lr: float, s: Sizes, train: ByteWindows, heldout: ByteWindows) -> dict:
    """Train one (row, learning rate) and measure it.

    The harness times whole ``engine.train_step`` calls; ``optimizer.step`` is timed inside them
    by the optimizer's step hooks, and forward+backward is the difference (it also holds the
    step's collation and the engine's finiteness check, the same for every row).

    Returns:
        Curves, held-out loss, state bytes (counted and formula), step times.
    """
    engine, config = make_engine(name, lr, s, train)
    model, opt = engine.model, engine.optimizer
    opt_t = _record_step_times(opt, s.device)
    curve, step_t, diverged = [], [], False
    for k in range(s.steps):
        _sync(s.device)
        t0 = time.perf_counter()
        try:
            curve.append(engine.train_step(k).loss)
        except NonFiniteLoss as err:
            curve.append(float("nan") if err.value is None else err.value)
            diverged = True
            break
        _sync(s.device)
        step_t.append(time.perf_counter() - t0)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    out = {"method": name, "lr": lr, "train_curve": curve, "diverged": diverged,
           "heldout_loss": float("nan") if diverged else heldout_loss(model, heldout, s),
           "state_bytes": counted_state_bytes(opt), "formula_bytes": ROWS[name].formula_bytes(model, config),
           "param_bytes": param_bytes(model), "grad_bytes": trainable,
           "step_s": mean(step_t), "opt_step_s": mean(opt_t), "max_opt_step_s": max(opt_t, default=0.0),
           "fwd_bwd_median_s": median([a - b for a, b in zip(step_t, opt_t)])}
    if ROWS[name].truncate and not diverged:
        from rankwise.optim.q3r import truncate_to_factorized
        small = copy.deepcopy(model)
        truncate_to_factorized(small, s.rank)
        out["heldout_loss_truncated"] = heldout_loss(small, heldout, s)
    return out


def peak_tensor_mib(name: str, lr: float, s: Sizes, train: ByteWindows) -> dict | None:
    """Peak memory over two training steps (the first one computes every subspace), by the
    shared meter of :mod:`rankwise.memory` (CUDA ``max_memory_allocated``; on CPU the peak of
    live tensors from the profiler's allocation events) added to the model's tensor bytes at
    the start. On CPU the optimizer's share of that peak comes from a second pass under torch's
    ``MemTracker``, which attributes every tensor to its owner (the shared meter does not).

    Returns:
        ``{"total": MiB, "optimizer": MiB or None, "memory_meter": name}``.
    """
    from rankwise.memory import PeakMemory, tensor_bytes
    engine, _ = make_engine(name, lr, s, train)
    start = tensor_bytes(engine.model)
    with PeakMemory(s.device) as mem:
        for k in range(2):
            engine.train_step(k)
    out = {"total": (start + mem.peak_bytes) / 2**20, "optimizer": None, "memory_meter": mem.meter}
    if s.device.startswith("cuda"):
        return out
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:  # pragma: no cover - private torch tool
        return out
    engine, _ = make_engine(name, lr, s, train)
    for p in engine.model.parameters():   # MemTracker hooks every parameter; a released dense
        if p.stride() == (0, 0):          # weight (never used, outside the optimizer) must accept it
            p.requires_grad_(True)
    tracker = MemTracker()
    tracker.track_external(engine.model, engine.optimizer)
    with tracker:
        for k in range(2):
            engine.train_step(k)
            tracker.reset_mod_stats()
    cpu = next(iter(tracker.get_tracker_snapshot("peak").values()))
    out["optimizer"] = cpu[next(k for k in cpu if str(k).endswith("OPT"))] / 2**20
    return out
