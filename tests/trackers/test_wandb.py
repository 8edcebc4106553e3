"""W&B: an offline run by default, read back from its transaction log with W&B's own records."""
from __future__ import annotations

import pytest

from rankwise.trackers.wandb import Wandb, WandbConfig

pytest.importorskip("wandb")


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_ERROR_REPORTING", raising=False)


def test_offline_run_holds_the_fed_values(fed, tmp_path, offline):
    lines = []
    console = type("C", (), {"print": lambda self, x, **k: lines.append(x)})()
    cfg = WandbConfig(project="p", run_name="r", tags=["a", "b"])
    fed.feed(Wandb(cfg, tmp_path, fed.config, console=console))
    got = fed.readers["wandb"](tmp_path)
    assert got["history"] == fed.expected                        # float64 JSON: exact
    assert got["config"] == fed.config
    assert {k: got["final"][k] for k in fed.final} == fed.final
    assert got["info"] == {"project": "p", "name": "r", "tags": ["a", "b"], "mode": "offline", "exit_code": 0}
    [line] = lines
    assert line.startswith(f"wandb: offline run in {tmp_path}/wandb/offline-run-") and "wandb sync" in line


def test_defaults_name_the_run_after_its_folder_and_stay_offline(fed, tmp_path, offline):
    import os
    run = tmp_path / "my-run"
    fed.feed(Wandb(WandbConfig(), run, fed.config))
    info = fed.readers["wandb"](run)["info"]
    assert (info["project"], info["name"]) == ("rankwise", "my-run")
    assert os.environ["WANDB_ERROR_REPORTING"] == "false"        # offline: no error reports sent


def test_wandb_mode_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert WandbConfig().resolved_mode() == "disabled"
    assert WandbConfig(mode="offline").resolved_mode() == "offline"   # the entry wins
    monkeypatch.delenv("WANDB_MODE")
    assert WandbConfig().resolved_mode() == "offline"


def test_a_failed_fit_ends_the_run_with_exit_code_1(fed, tmp_path, offline):
    fed.feed(Wandb(WandbConfig(), tmp_path, fed.config), crash_after=3)
    got = fed.readers["wandb"](tmp_path)
    assert got["info"]["exit_code"] == 1
    assert got["history"]["train/loss"] == [(2, 0.5)] and "eval_loss" not in got["final"]
