"""The train recipe's reporting callbacks: trackers on the first process only, and the final
metrics handed to each tracker once."""
from __future__ import annotations

from types import SimpleNamespace

from rankwise.recipes.config import load_run_config
from rankwise.recipes.reports import finish_trackers, report_callbacks
from rankwise.trackers.common import Tracker


def test_trackers_run_on_the_first_process_only(tmp_path):
    cfg = load_run_config(None, base={"train": {"log_to": ["tensorboard", "wandb", "mlflow"]}})
    session = SimpleNamespace(cfg=cfg, task=object())
    assert report_callbacks(session, tmp_path, log=None, write=False) == []   # torchrun rank > 0
    assert list(tmp_path.iterdir()) == []


def test_finish_hands_the_metrics_to_each_tracker_once():
    seen = []

    class Probe(Tracker):
        def log_final(self, metrics):
            seen.append(metrics)

        def close(self, ok):
            seen.append(ok)

    probe = Probe(None, "run", {})
    finish_trackers([object(), probe], {"eval_loss": 1.5})
    assert seen == []                                  # never opened: nothing to finish
    probe._open = True
    finish_trackers([probe, object()], {"eval_loss": 1.5})
    finish_trackers([probe], {"eval_loss": 9.0})
    assert seen == [{"eval_loss": 1.5}, True]
