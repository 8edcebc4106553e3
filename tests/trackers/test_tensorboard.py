"""TensorBoard: event files in ``RUN_DIR/tensorboard``, read back with its ``EventAccumulator``."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from rankwise.trackers.tensorboard import TensorBoard, TensorBoardConfig

pytest.importorskip("tensorboard")


def approx(history):
    return {k: [(s, pytest.approx(v, rel=1e-7)) for s, v in vals] for k, vals in history.items()}


def test_events_hold_the_fed_values(fed, tmp_path):
    lines = []
    console = type("C", (), {"print": lambda self, x, **k: lines.append(x)})()
    fed.feed(TensorBoard(TensorBoardConfig(), tmp_path, fed.config, console=console))
    got = fed.readers["tensorboard"](tmp_path)
    assert got["history"] == approx(fed.expected)              # float32 events
    assert got["config"] == fed.config
    assert got["final"] == pytest.approx({k: v for k, v in fed.final.items() if k != "method"}, rel=1e-7)
    folder = tmp_path / "tensorboard"
    assert lines == [f"tensorboard: writing to {folder} (view: tensorboard --logdir {folder})"]


def test_a_resumed_fit_purges_the_steps_past_its_checkpoint(fed, tmp_path):
    fed.feed(TensorBoard(TensorBoardConfig(), tmp_path, fed.config))
    again = TensorBoard(TensorBoardConfig(), tmp_path, fed.config)
    state = SimpleNamespace(step=2, start_step=2, total_steps=4, last_eval=None, stopped_at=None, began=0.0)
    engine = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"lr": 0.9}]))
    again.on_fit_start(engine, state)
    state.step = 3
    again.on_step_end(engine, state, SimpleNamespace(loss=9.0, aux={}, metrics={}))
    again.close(ok=True)
    got = fed.readers["tensorboard"](tmp_path)["history"]
    assert got["train/loss"] == [(2, 0.5), (3, 9.0)]            # step 4 of the first fit purged
