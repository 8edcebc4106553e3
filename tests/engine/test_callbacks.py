"""The engine's loop and its callbacks: hook order, resume from a step, Ctrl-C, checkpoints,
the event log, evaluation, early stopping (when it stops, in steps) and the progress bar."""
from __future__ import annotations

import json
from io import StringIO

import pytest

from engine_helpers import engine
from rankwise.engine.callbacks import Checkpoint, EarlyStopping, Evaluate, EventLog, ProgressBar
from rankwise.engine.loop import StepResult, TrainState


class Recorder:
    """Writes down every hook call as ``name`` or ``name:step``."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        self.calls: list[str] = []
        self.interrupt_at = interrupt_at

    def on_fit_start(self, eng, state):
        self.calls.append(f"start:{state.step}")

    def on_step_end(self, eng, state, result):
        self.calls.append(f"step:{state.step}")
        if state.step == self.interrupt_at:
            raise KeyboardInterrupt

    def on_interrupt(self, eng, state):
        self.calls.append(f"interrupt:{state.step}")

    def on_fit_exit(self, eng, state):
        self.calls.append("exit")

    def on_fit_end(self, eng, state):
        self.calls.append("end")


class Lines(list):
    """Stands in for an :class:`EventLog`: keeps the lines written to it."""

    write = list.append


def scripted(eng, metric: str, values: list[float], every: int, at_end: bool = False) -> Lines:
    """An :class:`Evaluate` callback whose evaluations return ``values`` in turn; returns the
    lines it logs (``{"step", metric}``)."""
    it = iter(values)
    eng.evaluate = lambda data, batch_size: {metric: next(it)}
    log = Lines()
    eng.callbacks.insert(0, Evaluate(data=None, batch_size=4, every=every, log=log, at_end=at_end))
    return log


def test_hooks_run_in_order_and_a_resumed_fit_starts_at_its_step():
    rec = Recorder()
    state = engine(callbacks=[rec]).fit(5, start_step=3)
    assert rec.calls == ["start:3", "step:4", "step:5", "exit", "end"]
    assert (state.step, state.start_step, state.total_steps) == (5, 3, 5)


def test_ctrl_c_runs_on_interrupt_then_exit_and_not_end():
    rec = Recorder(interrupt_at=2)
    with pytest.raises(KeyboardInterrupt):
        engine(callbacks=[rec]).fit(5)
    assert rec.calls == ["start:0", "step:1", "step:2", "interrupt:2", "exit"]


def test_checkpoints_every_n_steps_on_interrupt_and_at_the_end():
    saved = []
    engine(callbacks=[Checkpoint(lambda eng, st: saved.append(st.step), every=2)]).fit(5)
    assert saved == [2, 4, 5]
    saved.clear()
    with pytest.raises(KeyboardInterrupt):
        engine(callbacks=[Checkpoint(lambda eng, st: saved.append(st.step), every=0),
                          Recorder(interrupt_at=3)]).fit(5)
    assert saved == [3]


def test_event_log_writes_every_n_steps_and_the_last_and_a_resume_drops_later_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    results = []
    eng = engine(callbacks=[EventLog(path, every=2)], lr=0.25)
    orig = eng.train_step
    eng.train_step = lambda step: results.append(orig(step)) or results[-1]
    eng.fit(5)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [e["step"] for e in lines] == [2, 4, 5]
    assert [e["loss"] for e in lines] == [results[1].loss, results[3].loss, results[4].loss]
    assert all(e["lr"] == 0.25 for e in lines)
    engine(callbacks=[EventLog(path, every=2)]).fit(3, start_step=3)   # resume from step 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [2]


def test_evaluate_every_n_steps_and_once_at_the_end():
    eng = engine()
    log = scripted(eng, "eval_loss", [3.0, 2.0, 1.0], every=2, at_end=True)
    state = eng.fit(5)
    assert log == [{"step": 2, "eval_loss": 3.0}, {"step": 4, "eval_loss": 2.0}, {"step": 5, "eval_loss": 1.0}]
    assert state.last_eval == {"eval_loss": 1.0}


@pytest.mark.parametrize("every, patience, mode, metric, values, stops_at, best", [
    # evaluations at steps 1, 2, 3, 4: 4.0 is the best; 4.5 and 4.2 are two without improvement
    (1, 2, "min", "eval_loss", [5.0, 4.0, 4.5, 4.2, 3.0, 2.0], 4, 4.0),
    # an improvement resets the count: bad at 3, better at 4, bad at 5 and 6
    (1, 2, "min", "eval_loss", [5.0, 4.0, 4.5, 3.0, 3.5, 3.2, 1.0], 6, 3.0),
    # evaluations at steps 2, 4: the steps between see the same metrics and do not count them twice
    (2, 1, "min", "eval_loss", [2.0, 2.5, 1.0, 1.0], 4, 2.0),
    # accuracy is maximised; an equal value is no improvement
    (1, 1, "max", "eval_accuracy", [0.5, 0.6, 0.6, 0.9], 3, 0.6),
], ids=["loss", "reset", "every-2", "accuracy"])
def test_early_stopping_stops_after_patience_evaluations_without_improvement(
        every, patience, mode, metric, values, stops_at, best):
    stop = EarlyStopping(metric, patience=patience, mode=mode)
    eng = engine(callbacks=[stop])
    log = scripted(eng, metric, values, every=every)
    state = eng.fit(20)
    assert state.step == stops_at and state.should_stop and log[-1]["step"] == stops_at
    assert stop.best == best and stop.bad == patience


def test_early_stopping_ignores_evaluations_without_its_metric():
    stop = EarlyStopping("eval_accuracy", patience=1)
    eng = engine(callbacks=[stop])
    scripted(eng, "eval_loss", [1.0, 2.0, 3.0, 4.0], every=1)
    assert eng.fit(4).step == 4 and stop.bad == 0


def test_progress_bar_reports_tokens_and_examples_per_second(monkeypatch):
    import time

    from rich.console import Console
    bar = ProgressBar("lora", Console(file=StringIO(), width=160), tokens=True)
    state = TrainState(total_steps=4, began=100.0)
    bar.on_fit_start(None, state)
    monkeypatch.setattr(time, "perf_counter", lambda: 102.0)              # 2 s after the start
    state.step = 1
    bar.on_step_end(None, state, StepResult(loss=1.0, examples=8, targets=900, tokens=1000))
    fields = bar._bar.tasks[0].fields
    assert (fields["tok"], fields["ex"], fields["loss"]) == (500.0, 4.0, 1.0)
    assert bar._bar.tasks[0].completed == 1
    monkeypatch.undo()
    bar.on_fit_exit(None, state)
    assert "tok/s" in bar.console.file.getvalue() and bar._bar is None


def test_progress_bar_of_a_fit_that_runs_no_step_prints_no_nan_loss():
    """A resume that starts at the last step runs no step: the bar has no loss to show."""
    from rich.console import Console
    bar = ProgressBar("lora", Console(file=StringIO(), width=160))
    state = TrainState(step=4, start_step=4, total_steps=4)
    bar.on_fit_start(None, state)
    bar.on_fit_exit(None, state)
    text = bar.console.file.getvalue()
    assert "4/4" in text and "loss -" in text and "nan" not in text
