"""The one training engine: ``rankwise train``, federated clients, ``compare`` and the
benchmarks all step a model through :class:`Engine`.

One optimizer step (:meth:`Engine.train_step`):

1. draw the step's examples (a pure function of ``(seed, step)``, so a resumed run sees the
   batches an uninterrupted one would) and split them into ``grad_accum`` micro-batches;
2. per micro-batch: forward under autocast (``precision``), loss = task loss summed over its
   targets / the targets of the *whole step*, plus the adapters' auxiliary losses and any
   ``loss_hooks`` (a federated strategy's client-side terms), backward;
3. unscale (fp16), clip, optimizer step (losses go to optimizers that need the value, NGN-M),
   scheduler step.

Callbacks (:mod:`rankwise.engine.callbacks`) do everything around it: logging, evaluation,
checkpoints, plots, early stopping, the progress bar.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from rankwise.core.protocol import aux_losses
from rankwise.engine.buckets import pad_to_bucket
from rankwise.engine.offload import OffloadActivations
from rankwise.engine.per_layer import PerLayerUpdates
from rankwise.engine.per_layer import problems as per_layer_problems
from rankwise.engine.precision import PRECISIONS, autocast
from rankwise.engine.task import Task
from rankwise.errors import RankwiseError

LossHook = Callable[[nn.Module, int], torch.Tensor]


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """Example indices of training step ``step`` (0-based), independent of any state.

    Each epoch is a fresh permutation seeded by ``(seed, epoch)``, so a resumed run draws
    exactly the batches an uninterrupted run would.
    """
    out: list[int] = []
    pos = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n)
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        perm = torch.randperm(n, generator=g)
        take = min(batch_size - len(out), n - offset)
        out.extend(perm[offset: offset + take].tolist())
        pos += take
    return out


def split(items: list, parts: int) -> list[list]:
    """Split ``items`` into ``parts`` contiguous chunks whose sizes differ by at most one."""
    k, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + k + (1 if i < r else 0)
        out.append(items[start:end])
        start = end
    return [c for c in out if c]


def draw_batches(dataset: Any, task: Task, step: int, batch_size: int, seed: int, device: str,
                 grad_accum: int = 1, dist: Any = None, schedule: Any = None
                 ) -> list[dict[str, torch.Tensor]]:
    """The collated micro-batches of step ``step``: its examples (:func:`batch_indices`), this
    process's share of them under ``dist``, split into ``grad_accum`` micro-batches (or, with a
    ``schedule``, its ``micro_batches`` of the same global examples: Skrull).

    Args:
        dataset: Indexable examples with ``pad_id``.
        task: Collates them.
        step: The step (1-based for training; calibration uses its own range).
        batch_size: Examples of the whole step (capped at the dataset's size).
        seed: The run's seed (the draw is a pure function of seed and step).
        device: Where the tensors go.
        grad_accum: Micro-batches per step.
        dist: A ``Distributed`` whose ``shard`` picks this process's examples, or ``None``.
        schedule: A :class:`rankwise.engine.skrull.Skrull` (``data.schedule: skrull``), or
            ``None`` for contiguous shares and micro-batches.

    Returns:
        The micro-batches (dicts of tensors on ``device``).
    """
    n = len(dataset)
    idx = batch_indices(step, n, min(batch_size, n), seed)
    if schedule is not None:  # the same global examples, grouped by cost (engine/skrull.py)
        micro = [[dataset[i] for i in m] for m in schedule.micro_batches(dataset, idx)]
        return [{k: v.to(device) for k, v in task.collate(m, dataset.pad_id).items()} for m in micro]
    if dist is not None:
        idx = dist.shard(idx)  # this process's share of the global batch
    micro = split([dataset[i] for i in idx], grad_accum)
    return [{k: v.to(device) for k, v in task.collate(m, dataset.pad_id).items()} for m in micro]


class NonFiniteLoss(RankwiseError):
    """The loss, or the optimizer's arithmetic, left the finite range at ``step`` (1-based).

    Args:
        step: The step that failed.
        value: The loss value, or ``None`` when the optimizer's update overflowed.
    """

    def __init__(self, step: int, value: float | None) -> None:
        what = (f"loss became {value}" if value is not None else
                "the optimizer's update overflowed (weights would become inf/nan)")
        super().__init__(f"{what} at step {step}; lower optim.lr or set train.grad_clip")
        self.step, self.value = step, value


@dataclass
class StepResult:
    """What one optimizer step measured.

    Attributes:
        loss: Task loss per target over the whole step.
        aux: Auxiliary losses by name (already weighted), averaged over micro-batches.
        examples: Examples in the step.
        targets: Loss targets (examples or predicted tokens) in the step.
        tokens: Input tokens (attention-mask ones) in the step.
        metrics: The task's own measurements (DPO's rewards), logged beside the loss.
    """

    loss: float
    aux: dict[str, float] = field(default_factory=dict)
    examples: int = 0
    targets: int = 0
    tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainState:
    """Where a :meth:`Engine.fit` is (shared with callbacks).

    Attributes:
        step: Optimizer steps done.
        start_step: Step the fit began at (after a resume).
        total_steps: Step the fit ends at.
        prior_time: Training seconds of earlier sessions (from a checkpoint).
        began: ``time.perf_counter()`` at the start of this session.
        should_stop: Set by a callback to end the fit after this step (early stopping).
        last_eval: The newest evaluation metrics.
        stopped_at: ``time.perf_counter()`` when the last step finished.
    """

    step: int = 0
    start_step: int = 0
    total_steps: int = 0
    prior_time: float = 0.0
    began: float = field(default_factory=time.perf_counter)
    should_stop: bool = False
    last_eval: dict[str, float] = field(default_factory=dict)
    stopped_at: float | None = None

    @property
    def elapsed(self) -> float:
        """Training seconds including earlier sessions (frozen once the last step is done, so
        the final evaluation does not count as training)."""
        end = time.perf_counter() if self.stopped_at is None else self.stopped_at
        return self.prior_time + end - self.began


class Engine:
    """Steps ``model`` on ``dataset`` with ``optimizer`` for ``task``.

    Args:
        model: The (adapted) model, already on ``device``.
        task: How examples become a loss.
        optimizer: Any ``torch.optim.Optimizer`` over the trainable parameters.
        dataset: Indexable examples (``dataset[i] -> dict``) with ``len`` and ``pad_id``.
        batch_size: Examples per optimizer step (split into ``grad_accum`` micro-batches).
        seed: Seeds the batch order.
        scheduler: Learning-rate scheduler stepped after every optimizer step (optional).
        grad_accum: Micro-batches per step.
        grad_clip: Max gradient norm (0 or ``None`` = off).
        precision: ``fp32``, ``bf16`` or ``fp16`` autocast (fp16 adds a gradient scaler).
        device: Where batches go.
        loss_hooks: Extra loss terms by name, ``fn(model, step) -> tensor``, added to every
            micro-batch (weighted by its share of the step's examples) and logged by name.
        callbacks: See :mod:`rankwise.engine.callbacks`.
        dist: A :class:`rankwise.engine.distributed.Distributed` under torchrun: ``batch_size``
            becomes the global batch, this process takes its share, counts and gradients are
            summed over processes (``None`` or one process: nothing changes).
        offload_activations: Keep the tensors the forward saves for backward in pinned host
            memory until the backward (:mod:`rankwise.engine.offload`; no effect on a CPU
            device).
        schedule: Groups each global step's examples into processes and micro-batches by cost
            (:class:`rankwise.engine.skrull.Skrull`, built for this process), or ``None``.
        per_layer: Step each parameter in the backward as soon as its gradient is complete and
            free it (:mod:`rankwise.engine.per_layer`); needs ``grad_accum`` 1, no clipping, no
            fp16 scaler, one process.
        buckets: Lengths every training and evaluation batch is right-padded to (the smallest
            that holds it; :mod:`rankwise.engine.buckets`: masked, the same loss), so a compiled
            model sees few shapes; ``()``: lengths as they come. Settable later (``train.compile:
            auto`` turns them on with the compilation).

    Raises:
        RankwiseError: An unknown precision, or ``per_layer`` with settings it cannot follow.
    """

    def __init__(self, model: nn.Module, task: Task, optimizer: torch.optim.Optimizer, dataset: Any,
                 batch_size: int, seed: int = 0, scheduler: Any = None, grad_accum: int = 1,
                 grad_clip: float | None = None, precision: str = "fp32", device: str = "cpu",
                 loss_hooks: Mapping[str, LossHook] | None = None, callbacks: Iterable[Any] = (),
                 dist: Any = None, offload_activations: bool = False,
                 per_layer: bool = False, schedule: Any = None, buckets: tuple[int, ...] = ()) -> None:
        if precision not in PRECISIONS:
            raise RankwiseError(f"train.precision: got {precision!r}; expected one of {list(PRECISIONS)}")
        self.model, self.task, self.optimizer, self.dataset = model, task, optimizer, dataset
        self.batch_size, self.seed, self.scheduler = batch_size, seed, scheduler
        self.grad_accum, self.grad_clip, self.precision = max(1, grad_accum), grad_clip, precision
        self.device = str(device)
        self.loss_hooks = dict(loss_hooks or {})
        self.callbacks = list(callbacks)
        self.scaler = torch.amp.GradScaler(self.device.split(":")[0]) if precision == "fp16" else None
        self.params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        self.dist = dist if dist is not None and dist.active else None
        self.per_layer = None
        if per_layer:
            bad = per_layer_problems(self.grad_accum, grad_clip, precision,
                                     self.dist.world if self.dist is not None else 1)
            if getattr(optimizer, "needs_closure_loss", False):
                bad.append(f"optim.per_layer: {type(optimizer).__name__} needs the step's loss and "
                           "every gradient; set optim.per_layer: false")
            if bad:
                raise RankwiseError("; ".join(bad))
            self.per_layer = PerLayerUpdates(self.params, optimizer)
        # one object for the whole fit: one side stream, and its stats add up over the steps
        self.offloader = OffloadActivations(self.device) if offload_activations else None
        self.schedule = schedule
        self.buckets = tuple(buckets)

    # ----- one step ---------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context of the configured precision (a no-op for fp32)."""
        return autocast(self.precision, self.device)

    def offload(self) -> contextlib.AbstractContextManager:
        """The context around each micro-batch's forward: ``self.offloader`` (an
        :class:`OffloadActivations`, inert on a CPU device) when offloading is on, else a no-op."""
        return self.offloader if self.offloader is not None else contextlib.nullcontext()

    def step_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The collated micro-batches of optimizer step ``step``, on the engine's device."""
        return draw_batches(self.dataset, self.task, step, self.batch_size, self.seed, self.device,
                            self.grad_accum, self.dist, self.schedule)

    def train_step(self, step: int) -> StepResult:
        """One optimizer step on the examples of ``step`` (see the module docstring).

        Raises:
            NonFiniteLoss: If the loss is NaN/Inf or the optimizer overflows; parameters are
                left as they were before the step's update.
        """
        model, opt = self.model, self.optimizer
        model.train()
        batches = self.task.before_step(model, self.step_batches(step), step, self.seed)
        if self.buckets:  # after before_step: GRPO's rollouts are padded, its prompts are not
            batches = [pad_to_bucket(b, self.buckets, self.dataset.pad_id) for b in batches]
        targets = sum(self.task.count_targets(b) for b in batches)
        examples = sum(len(b["input_ids"]) for b in batches)
        if self.dist is not None:  # normalise by the targets of the whole global step
            targets, examples = (int(x) for x in self.dist.all_sum([targets, examples]))
        norm = max(targets, 1)
        total = 0.0
        aux_sum: dict[str, float] = {}
        bad = None
        if self.per_layer is not None:
            self.per_layer.arm()  # each parameter steps in the backward below
        for batch in batches:
            share = len(batch["input_ids"]) / examples  # per-batch means weigh by their examples
            with self.autocast(), self.offload():
                loss_sum = self.task.loss_sum(model, batch)[0]  # the output (logits) freed now
                loss = loss_sum / norm
                extra = aux_losses(model)
                extra.update({name: hook(model, step) for name, hook in self.loss_hooks.items()})
                objective = loss + sum(v * share for v in extra.values()) if extra else loss
            if not torch.isfinite(objective.detach()):
                if self.dist is None:
                    opt.zero_grad(set_to_none=True)
                    if self.per_layer is not None:
                        self.per_layer.disarm()
                    raise NonFiniteLoss(step + 1, float(objective.detach()))
                bad = float(objective.detach())  # every process raises together, below
            (self.scaler.scale(objective) if self.scaler else objective).backward()
            total += float(loss_sum.detach())
            for k, v in extra.items():
                aux_sum[k] = aux_sum.get(k, 0.0) + float(v.detach()) * share
        if self.per_layer is not None:
            self.per_layer.disarm()
        tokens = int(sum(int(b["attention_mask"].sum()) for b in batches))
        if self.dist is not None:
            total, aux_sum, bad, tokens = self.dist.reduce_step(total, aux_sum, bad, tokens)
            if bad is not None:
                opt.zero_grad(set_to_none=True)
                raise NonFiniteLoss(step + 1, bad)
            self.dist.sync_grads(self.params)
        mean = total / norm
        # The loss an optimizer sees (NGN-M's f) is the objective whose gradient it steps on:
        # the task loss plus the auxiliary and hook terms.
        self._update(step, mean + sum(aux_sum.values()))
        return StepResult(loss=mean, aux=aux_sum, examples=examples, targets=targets, tokens=tokens,
                          metrics=self.task.step_metrics())

    def _update(self, step: int, loss: float) -> None:
        opt = self.optimizer
        if self.per_layer is not None:  # every parameter stepped in the backward
            if self.scheduler is not None:
                self.scheduler.step()
            return
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        if self.grad_clip:
            nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        try:
            kwargs = {"loss": torch.tensor(loss)} if getattr(opt, "needs_closure_loss", False) else {}
            if self.scaler is not None:
                self.scaler.step(opt, **kwargs)
                self.scaler.update()
            else:
                opt.step(**kwargs)
        except RuntimeError as err:  # e.g. AdamW: "value cannot be converted ... without overflow"
            if "overflow" not in str(err) and "cannot be converted" not in str(err):
                raise
            raise NonFiniteLoss(step + 1, None) from None
        finally:
            opt.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def check_finite(self, step: int) -> None:
        """Raise :class:`NonFiniteLoss` if a trainable weight is inf/NaN (before a checkpoint is
        written, so the last checkpoint on disk is always a good one; a whole pass over the
        weights, so it is not done every step: the next loss would show it anyway).

        Args:
            step: Steps done (named in the message).
        """
        if any(not bool(torch.isfinite(p).all()) for p in self.params):
            raise NonFiniteLoss(step, None)

    # ----- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, data: Any, batch_size: int) -> dict[str, float]:
        """The task's metrics over every example of ``data`` (``eval_loss``, ...)."""
        return evaluate(self.model, self.task, data, batch_size, self.device, self.autocast,
                        self.buckets)

    # ----- the loop -----------------------------------------------------------------------------
    def fit(self, steps: int, start_step: int = 0, prior_time: float = 0.0) -> TrainState:
        """Run steps ``start_step .. steps - 1`` with the callbacks.

        Returns:
            The final :class:`TrainState`.

        Raises:
            NonFiniteLoss: As :meth:`train_step`, after the ``on_fit_exit`` callbacks ran (they
                run however the loop ends; ``on_fit_end`` only when it completes).
            KeyboardInterrupt: After ``on_interrupt`` callbacks ran (they save a checkpoint).
        """
        state = TrainState(step=start_step, start_step=start_step, total_steps=steps,
                           prior_time=prior_time)
        self._call("on_fit_start", state)
        try:
            while state.step < steps and not state.should_stop:
                result = self.train_step(state.step)
                state.step += 1
                self._call("on_step_end", state, result)
            state.stopped_at = time.perf_counter()
        except KeyboardInterrupt:
            self._call("on_interrupt", state)
            raise
        finally:
            self._call("on_fit_exit", state)
        self._call("on_fit_end", state)
        return state

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, *args)

    # ----- resumable state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler, gradient-scaler and RNG state (for checkpoints)."""
        out = {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        if hasattr(self.schedule, "state_dict"):  # a stateful sampler (GAIN-RL)
            out["schedule"] = self.schedule.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        if hasattr(self.schedule, "load_state_dict") and "schedule" in state:
            self.schedule.load_state_dict(state["schedule"])
        torch.set_rng_state(state["torch_rng"])


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, data: Any, batch_size: int, device: str = "cpu",
             autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
             buckets: tuple[int, ...] = ()) -> dict[str, float]:
    """The task's metrics of ``model`` over every example of ``data`` (in eval mode).

    Args:
        model: The model.
        task: The task (collation, loss, metrics).
        data: Indexable examples with ``len`` and ``pad_id``.
        batch_size: Examples per forward.
        device: Where batches go.
        autocast: Context factory for mixed precision.
        buckets: Pad each batch to one of these lengths (:func:`pad_to_bucket`; ``()``: none).

    Returns:
        ``{"eval_loss": ..., "eval_accuracy" | "eval_perplexity": ...}``.
    """
    was_training = model.training
    model.eval()
    stats: dict[str, float] = {}
    for start in range(0, len(data), batch_size):
        items = [data[i] for i in range(start, min(start + batch_size, len(data)))]
        batch = {k: v.to(device) for k, v in task.collate(items, data.pad_id).items()}
        batch = pad_to_bucket(batch, buckets, data.pad_id)
        for part in task.eval_parts(model, batch):  # a causal LM's logits stay under a budget
            with autocast():
                loss_sum, out = task.loss_sum(model, part)
            task.eval_update(stats, part, out, loss_sum)
            del loss_sum, out  # freed before the next forward, not after it
    model.train(was_training)
    return task.eval_metrics(stats)


def linear_schedule(optimizer: torch.optim.Optimizer, steps: int, warmup_fraction: float):
    """Linear warm-up over ``warmup_fraction`` of ``steps``, then linear decay to zero."""
    warm = max(1, int(steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return max(0.0, (steps - step) / max(1, steps - warm))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


__all__ = ["Engine", "StepResult", "TrainState", "NonFiniteLoss", "batch_indices", "split",
           "evaluate", "linear_schedule"]
