"""``train.log_to`` entries resolve to the registered trackers' typed configs, every problem
reported at once; a tracker from outside the package is one registration."""
from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

from rankwise import registry, trackers
from rankwise.cli import main
from rankwise.errors import RankwiseError
from rankwise.recipes.config import load_run_config
from rankwise.trackers import MlflowConfig, TensorBoardConfig, WandbConfig
from rankwise.trackers.common import Tracker, TrackerConfig


def log_to(entries):
    return load_run_config(None, base={"train": {"log_to": entries}}).train.log_to


def test_names_and_mappings_become_typed_configs():
    got = log_to(["tensorboard", {"name": "wandb", "project": "p", "tags": ["a"]}, "mlflow"])
    assert got == [TensorBoardConfig(), WandbConfig(project="p", tags=["a"]), MlflowConfig()]
    assert repr(got) == "['tensorboard', {'name': 'wandb', 'project': 'p', 'tags': ['a']}, 'mlflow']"
    assert log_to([]) == []


def test_every_bad_entry_is_reported_at_once():
    with pytest.raises(RankwiseError) as err:
        log_to(["wandbb", {"name": "mlflow", "experimnt": "x"}, {"project": "p"}, "tensorboard",
                "tensorboard", {"name": "wandb", "mode": "cloud"}])
    msg = str(err.value)
    assert "train.log_to[0]: unknown tracker 'wandbb' (did you mean 'wandb'?); expected one of: mlflow, tensorboard, wandb" in msg
    assert "train.log_to[1].experimnt: unknown key (did you mean 'experiment'?)" in msg
    assert "train.log_to[2]: got {'project': 'p'}; expected a tracker name or {name: ..., ...}" in msg
    assert "train.log_to: tensorboard is listed twice; keep one entry" in msg
    assert "train.log_to[5].mode: got 'cloud'" in msg


def test_rankwise_list_shows_the_trackers():
    out = CliRunner().invoke(main, ["list"]).output.splitlines()
    assert {x.split()[1] for x in out if x.startswith("tracker")} >= {"mlflow", "tensorboard", "wandb"}


@dataclass
class ListConfig(TrackerConfig):
    """A tracker that keeps what it is given in memory."""

    name: str = "test-memory"
    prefix: str = ""


class ListTracker(Tracker):
    logged: list = []

    def open(self, start_step):
        time.sleep(0.05)
        ListTracker.logged = [("config", self.run_config)]
        return "test-memory: in memory"

    def log(self, values, step):
        ListTracker.logged.append((step, {self.config.prefix + k: v for k, v in values.items()}))

    def log_final(self, metrics):
        ListTracker.logged.append(("final", metrics))

    def close(self, ok):
        ListTracker.logged.append(("closed", ok))


def test_a_tracker_from_outside_is_one_registration(fed, tmp_path):
    registry.register("tracker", "test-memory", ListConfig, ListTracker, "in memory")
    [cfg] = log_to([{"name": "test-memory", "prefix": "x/"}])
    [tracker] = trackers.build([cfg], tmp_path, fed.config, every=2)
    state = fed.feed(tracker)
    assert state.began >= 0.05                                    # its start-up is not training time
    got = ListTracker.logged
    assert got[0] == ("config", fed.config) and got[-2:] == [("final", fed.final), ("closed", True)]
    steps = {}
    for step, values in got[1:-2]:
        for k, v in values.items():
            steps.setdefault(k, []).append((step, v))
    assert steps == {"x/" + k: v for k, v in fed.expected.items()}
