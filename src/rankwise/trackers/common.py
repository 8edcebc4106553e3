"""What every experiment tracker shares: its config's base and the callback that feeds it.

A tracker (``train.log_to``) is a registered kind, ``tracker``: one module per tracker with its
config dataclass (every default) and a :class:`Tracker` subclass that implements four small
methods: :meth:`Tracker.open`, :meth:`Tracker.log`, :meth:`Tracker.log_final` and
:meth:`Tracker.close`. The base class turns the engine's callbacks into those calls, so every
tracker receives the same values:

* every ``train.log_every`` steps (and the last), what ``events.jsonl``'s step line holds:
  ``train/loss``, ``train/lr``, each auxiliary loss and task measurement as ``train/<name>``;
* after each evaluation, ``eval/<metric>`` (``eval_loss`` -> ``eval/loss``) at its step;
* at the start, the resolved run config (the dict ``config.yaml`` holds); the seconds a tracker
  takes to start (its imports, W&B's service) are not counted as training (``train_time_s``,
  examples/s);
* at the end, the run's final metrics (``metrics.json``), through :meth:`Tracker.finish`, which
  the train recipe calls once ``metrics.json`` is written.

Nothing here imports a tracker's package: each module imports its own inside ``open``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar


@dataclass
class TrackerConfig:
    """Base of a tracker's config: one entry of ``train.log_to``, chosen by ``name`` from the
    registry (kind ``tracker``). A tracker's config subclasses it, re-declares ``name`` and holds
    every default of the tracker.

    Attributes:
        name: The registered tracker (``rankwise list`` shows them).
    """

    name: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__repr__ = TrackerConfig.__repr__  # in the class's own dict: @dataclass keeps it

    def __repr__(self) -> str:
        """The entry as a user writes it: ``'wandb'``, or the mapping when a setting differs
        from its default (messages quote ``train.log_to`` this way)."""
        return repr(self.entry())

    def entry(self) -> str | dict:
        """The ``train.log_to`` entry: the bare name when every setting is the default, else
        ``{name: ..., <setting>: ...}`` with the settings that differ."""
        default = type(self)()
        changed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if getattr(self, f.name) != getattr(default, f.name)}
        return {"name": self.name, **changed} if changed else self.name

    def problems(self) -> list[str]:
        """Return value errors (``"field: message"``); default: none."""
        return []


def step_values(result: Any, lr: float) -> dict[str, float]:
    """The scalars of one step line: ``train/loss``, ``train/lr`` and ``train/<name>`` for each
    auxiliary loss and task measurement (the same values ``events.jsonl`` holds)."""
    out = {"train/loss": float(result.loss), "train/lr": float(lr)}
    for name, value in {**result.aux, **getattr(result, "metrics", {})}.items():
        out[f"train/{name}"] = float(value)
    return out


def eval_values(metrics: dict[str, Any]) -> dict[str, float]:
    """An evaluation's scalars, ``eval_loss`` -> ``eval/loss``."""
    return {f"eval/{k.removeprefix('eval_')}": float(v) for k, v in metrics.items() if is_number(v)}


def is_number(value: Any) -> bool:
    """Whether ``value`` is a finite int or float (not a bool): what a tracker plots."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plain(config: dict) -> dict:
    """``config`` with every value JSON-safe (paths and other objects as strings)."""
    return json.loads(json.dumps(config, default=str))


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


class Tracker:
    """Base callback of the trackers (see the module docstring for what it logs, and when).

    Args:
        config: The tracker's config (its registered dataclass).
        folder: The run folder; a tracker writes into a folder of its own inside it.
        run_config: The resolved run config as a plain dict (``config.yaml``).
        every: Steps between step lines (``train.log_every``; the last step is always logged).
        console: Where the one line saying where the tracker writes goes (a ``rich`` console,
            or anything with ``print``); ``None``: nowhere.

    Attributes:
        module: Class attribute: the import name of the package the tracker needs.
        extra: Class attribute: the rankwise extra that installs it (``pip install
            'rankwise[EXTRA]'``).
    """

    module: ClassVar[str] = ""
    extra: ClassVar[str] = ""

    def __init__(self, config: Any, folder: Path, run_config: dict, every: int = 1,
                 console: Any = None) -> None:
        self.config, self.folder, self.run_config = config, Path(folder), plain(run_config)
        self.every, self.console = max(1, every), console
        self._seen: Any = None
        self._open = False

    # --- what a tracker implements -------------------------------------------------------
    def open(self, start_step: int) -> str:
        """Start the tracker's run and log the run config.

        Args:
            start_step: The step the fit starts at (0, or a resumed run's checkpoint step).

        Returns:
            One line saying where the tracker writes (printed to the console).
        """
        raise NotImplementedError

    def log(self, values: dict[str, float], step: int) -> None:
        """Log scalars at ``step``."""
        raise NotImplementedError

    def log_final(self, metrics: dict[str, Any]) -> None:
        """Log the run's final metrics (``metrics.json``: numbers and strings)."""
        raise NotImplementedError

    def close(self, ok: bool) -> None:
        """End the tracker's run; ``ok`` is ``False`` when the fit failed or was interrupted."""
        raise NotImplementedError

    def flush(self) -> None:
        """Write what is buffered (the fit ended; the final metrics follow). Default: nothing."""

    # --- the engine's callbacks ----------------------------------------------------------
    def on_fit_start(self, engine, state) -> None:
        t0 = time.perf_counter()
        where = self.open(state.start_step)
        state.began += time.perf_counter() - t0  # start-up (imports, W&B's service) is not training
        self._open, self._seen = True, state.last_eval
        if self.console is not None and where:
            self.console.print(where, soft_wrap=True)

    def on_step_end(self, engine, state, result) -> None:
        if state.step % self.every == 0 or state.step == state.total_steps:
            self.log(step_values(result, engine.optimizer.param_groups[0]["lr"]), state.step)
        self._eval(state)

    def _eval(self, state) -> None:
        if state.last_eval and state.last_eval is not self._seen:
            self._seen = state.last_eval
            self.log(eval_values(state.last_eval), state.step)

    def on_fit_exit(self, engine, state) -> None:
        if state.stopped_at is None and self._open:  # failed or interrupted: no final metrics
            self._open = False
            self.close(ok=False)

    def on_fit_end(self, engine, state) -> None:
        self._eval(state)  # the final evaluation
        self.flush()

    def finish(self, metrics: dict[str, Any]) -> None:
        """Log the final metrics and close (the train recipe calls it after ``metrics.json``).

        Args:
            metrics: What ``metrics.json`` holds.
        """
        if self._open:
            self._open = False
            self.log_final(plain(metrics))
            self.close(ok=True)


__all__ = ["TrackerConfig", "Tracker", "step_values", "eval_values", "flatten", "plain", "is_number"]
