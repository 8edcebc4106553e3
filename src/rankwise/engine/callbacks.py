"""Hooks around :class:`rankwise.engine.loop.Engine`: logging, evaluation, checkpoints, plots,
early stopping and the progress bar.

A callback is any object with some of these methods (all receive the engine first):

* ``on_fit_start(engine, state)``
* ``on_step_end(engine, state, result)`` - after every optimizer step (``result``:
  :class:`~rankwise.engine.loop.StepResult`)
* ``on_interrupt(engine, state)`` - Ctrl-C; the fit then re-raises ``KeyboardInterrupt``
* ``on_fit_exit(engine, state)`` - always, when the loop is left (close files)
* ``on_fit_end(engine, state)`` - after the last step, when nothing went wrong

They run in list order; an evaluation callback stores its metrics in ``state.last_eval`` for
the ones after it (early stopping, the final report).
"""
from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path
from typing import Any, Callable

from rankwise.core import atomic


def current_lr(engine) -> float:
    """The learning rate of the optimizer's first param group."""
    return float(engine.optimizer.param_groups[0]["lr"])


class EventLog:
    """Append one JSON line per ``every`` steps (loss, aux losses, lr, time) to ``path``.

    Lines after the resume point are dropped first, so a resumed run's file equals an
    uninterrupted run's. Other callbacks add lines (evaluations) through :meth:`write`.

    Args:
        path: ``events.jsonl``.
        every: Steps between lines (the last step is always written).
    """

    def __init__(self, path: Path, every: int = 1) -> None:
        self.path, self.every, self._file = Path(path), max(1, every), None

    def read(self, upto: int | None = None) -> list[dict]:
        """The lines written so far (up to step ``upto``). A line that is not a JSON object
        (a write cut short by a crash, an edit) is skipped with a warning: the log is a record
        of the run, never a reason to refuse resuming it."""
        if not self.path.is_file():
            return []
        lines = []
        for i, text in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            if not text.strip():
                continue
            try:
                entry = json.loads(text)
            except ValueError:
                entry = None
            if not isinstance(entry, dict):
                warnings.warn(f"{self.path} line {i} is not a JSON object; dropped from the log",
                              stacklevel=2)
                continue
            lines.append(entry)
        return [e for e in lines if upto is None or e.get("step", 0) <= upto]

    def write(self, entry: dict) -> None:
        """Append one line now."""
        if self._file is None:
            self._file = self.path.open("a")
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()

    def on_fit_start(self, engine, state) -> None:
        keep = self.read(state.start_step)
        atomic.write_bytes(self.path, "".join(json.dumps(e) + "\n" for e in keep).encode())

    def on_step_end(self, engine, state, result) -> None:
        if state.step % self.every == 0 or state.step == state.total_steps:
            self.write({"step": state.step, "loss": result.loss, **result.aux, **result.metrics,
                        "lr": current_lr(engine), "elapsed_s": round(state.elapsed, 3)})

    def on_fit_exit(self, engine, state) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Evaluate:
    """Evaluate on ``data`` every ``every`` steps (and at the end with ``at_end``).

    Args:
        data: Evaluation examples.
        batch_size: Examples per forward.
        every: Steps between evaluations (0 = never during the fit).
        log: An :class:`EventLog` that receives ``{"step", **metrics}`` lines.
        at_end: Also evaluate after the last step (the final metrics).
        memory: A :class:`MeasureMemory` that measures the evaluations apart from the steps.
    """

    def __init__(self, data: Any, batch_size: int, every: int = 0, log: EventLog | None = None,
                 at_end: bool = False, memory: "MeasureMemory | None" = None) -> None:
        self.data, self.batch_size, self.every, self.log, self.at_end = data, batch_size, every, log, at_end
        self.memory = memory

    def _run(self, engine, state) -> None:
        with self.memory.evaluating() if self.memory is not None else contextlib.nullcontext():
            state.last_eval = engine.evaluate(self.data, self.batch_size)
        if self.log is not None:
            self.log.write({"step": state.step, **state.last_eval})

    def on_step_end(self, engine, state, result) -> None:
        if self.every and state.step % self.every == 0 and state.step < state.total_steps:
            self._run(engine, state)

    def on_fit_end(self, engine, state) -> None:
        if self.at_end:
            self._run(engine, state)


class EarlyStopping:
    """Stop when ``metric`` has not improved for ``patience`` evaluations.

    Args:
        metric: A key of the evaluation metrics (``eval_loss``).
        patience: Evaluations without improvement before stopping.
        mode: ``min`` or ``max``.
    """

    def __init__(self, metric: str = "eval_loss", patience: int = 3, mode: str = "min") -> None:
        self.metric, self.patience, self.mode = metric, patience, mode
        self.best, self.bad, self._seen = math.inf if mode == "min" else -math.inf, 0, None

    def on_step_end(self, engine, state, result) -> None:
        ev = state.last_eval
        if not ev or self.metric not in ev or ev is self._seen:
            return
        self._seen = ev
        value = ev[self.metric]
        better = value < self.best if self.mode == "min" else value > self.best
        if better:
            self.best, self.bad = value, 0
        else:
            self.bad += 1
            state.should_stop = self.bad >= self.patience


class Checkpoint:
    """Save a crash-safe checkpoint every ``every`` steps, on Ctrl-C, and after the last step.

    Args:
        save: ``save(engine, state)`` writes one checkpoint (the train recipe's).
        every: Steps between checkpoints (0 = only on interrupt and at the end).
    """

    def __init__(self, save: Callable[[Any, Any], Any], every: int = 0) -> None:
        self.save, self.every = save, every

    def on_step_end(self, engine, state, result) -> None:
        if self.every and state.step % self.every == 0 and state.step < state.total_steps:
            self.save(engine, state)

    def on_interrupt(self, engine, state) -> None:
        self.save(engine, state)

    def on_fit_end(self, engine, state) -> None:
        self.save(engine, state)


class LossPlot:
    """Draw ``loss.png`` from an :class:`EventLog` after the fit (train and eval loss).

    Args:
        log: The event log to read.
        path: The PNG.
        title: Figure title.
    """

    def __init__(self, log: EventLog, path: Path, title: str) -> None:
        self.log, self.path, self.title = log, Path(path), title

    def on_fit_end(self, engine, state) -> None:
        from rankwise.plots import plot_loss
        plot_loss(self.log.read(state.step), self.path, title=self.title)


class ProgressBar:
    """A ``rich`` progress bar with loss, examples/s and (causal LM) tokens/s. The loss reads
    ``loss -`` until this session's first step (a resume that starts at the last step runs none).

    Args:
        description: Shown left of the bar.
        console: A ``rich`` console.
        tokens: Show tokens/s.
        disable: Show nothing.
    """

    def __init__(self, description: str, console: Any = None, tokens: bool = False,
                 disable: bool = False) -> None:
        self.description, self.console, self.tokens, self.disable = description, console, tokens, disable
        self._bar = None
        self._seen = [0, 0]

    def on_fit_start(self, engine, state) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        cols = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[loss_text]}"), TextColumn("{task.fields[ex]:.1f} ex/s")]
        if self.tokens:
            cols.append(TextColumn("{task.fields[tok]:.0f} tok/s"))
        cols.append(TimeRemainingColumn())
        self._bar = Progress(*cols, console=self.console, disable=self.disable, transient=False)
        self._bar.start()
        self._task = self._bar.add_task(self.description, total=state.total_steps,
                                        completed=state.start_step, loss=float("nan"), loss_text="loss -",
                                        ex=0.0, tok=0.0)

    def on_step_end(self, engine, state, result) -> None:
        import time
        self._seen[0] += result.examples
        self._seen[1] += result.tokens
        dt = max(time.perf_counter() - state.began, 1e-9)
        self._bar.update(self._task, completed=state.step, loss=result.loss,
                         loss_text=f"loss {result.loss:.4f}",
                         ex=self._seen[0] / dt, tok=self._seen[1] / dt)

    def on_fit_exit(self, engine, state) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class MeasureMemory:
    """The run's memory: the training steps' peak and, apart, the evaluations' peak.

    Folds the meter's events after every step (:meth:`rankwise.memory.PeakMemory.flush`), so on
    CPU the profiler holds one step's events, not a whole run's. Evaluations run inside
    :meth:`evaluating` (``Evaluate(..., memory=this)``), a meter kept apart, so an evaluation's
    peak never stands for the training's. A resumed run starts from the peaks its checkpoint
    recorded (:meth:`restore`): a resume that starts at the last step trains nothing and still
    reports the peak of the steps trained before.

    Args:
        meter: The :class:`~rankwise.memory.PeakMemory` the fit runs inside.
    """

    def __init__(self, meter: Any) -> None:
        self.meter = meter
        self.prior_bytes = self.prior_eval_bytes = 0
        self.eval_bytes = 0

    def on_step_end(self, engine, state, result) -> None:
        self.meter.flush()

    @contextlib.contextmanager
    def evaluating(self):
        """A block measured apart from the training steps (an evaluation)."""
        from rankwise.memory import PeakMemory
        with PeakMemory(self.meter.device, apart=True) as apart:
            yield
        self.eval_bytes = max(self.eval_bytes, apart.peak_bytes)

    def peaks(self) -> dict[str, Any]:
        """``{"peak_memory_mb", "eval_peak_memory_mb", "memory_meter"}`` of the run so far
        (earlier sessions included), for ``metrics.json`` and the checkpoints."""
        self.meter.flush()
        train = max(self.prior_bytes, self.meter.peak_bytes)
        ev = max(self.prior_eval_bytes, self.eval_bytes)
        return {"peak_memory_mb": round(train / 2 ** 20, 1),
                "eval_peak_memory_mb": round(ev / 2 ** 20, 1), "memory_meter": self.meter.meter}

    def restore(self, record: dict) -> None:
        """Start from a checkpoint's :meth:`peaks` (ignored when another meter wrote them:
        a run resumed on another kind of device).

        Args:
            record: The checkpoint's ``meta.json`` (``peak_memory_mb`` etc.; absent in
                checkpoints written before they were recorded).
        """
        if record.get("memory_meter") != self.meter.meter:
            return
        self.prior_bytes = int(float(record.get("peak_memory_mb") or 0) * 2 ** 20)
        self.prior_eval_bytes = int(float(record.get("eval_peak_memory_mb") or 0) * 2 ** 20)
