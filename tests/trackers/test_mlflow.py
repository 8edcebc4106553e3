"""MLflow: the file store in the run folder by default, read back through ``MlflowClient``."""
from __future__ import annotations

import pytest

from rankwise.trackers.mlflow import Mlflow, MlflowConfig

pytest.importorskip("mlflow")


@pytest.fixture
def local(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_DISABLE_TELEMETRY"):
        monkeypatch.delenv(name, raising=False)


def test_file_store_run_holds_the_fed_values(fed, tmp_path, local):
    import os
    lines = []
    console = type("C", (), {"print": lambda self, x, **k: lines.append(x)})()
    cfg = MlflowConfig(experiment="e", run_name="r", tags={"team": "x"})
    tracker = Mlflow(cfg, tmp_path, fed.config, console=console)
    fed.feed(tracker)
    got = fed.readers["mlflow"](tmp_path)
    assert got["history"] == fed.expected                        # float64: exact
    assert got["config"] == fed.config
    assert got["final"] == {**fed.final, "team": "x"}             # numbers as metrics, strings as tags
    info = got["info"]
    assert (info["experiment"], info["name"], info["status"]) == ("e", "r", "FINISHED")
    assert info["params"]["train.lr"] == "0.5" and info["params"]["train.log_to"] == "['x']"
    uri = (tmp_path / "mlruns").resolve().as_uri()
    assert lines == [f"mlflow: run {tracker.run_id} in {uri} (view: MLFLOW_ALLOW_FILE_STORE=true "
                     f"mlflow ui --backend-store-uri {uri})"]
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"       # no usage report sent


def test_tracking_uri_from_the_environment_and_the_entry(fed, tmp_path, local, monkeypatch):
    elsewhere = (tmp_path / "store").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    run = tmp_path / "run"
    assert Mlflow(MlflowConfig(), run, {}).tracking_uri() == elsewhere
    assert Mlflow(MlflowConfig(tracking_uri="sqlite:///x.db"), run, {}).tracking_uri() == "sqlite:///x.db"
    fed.feed(Mlflow(MlflowConfig(), run, fed.config))
    assert not (run / "mlruns").exists()
    got = fed.readers["mlflow"](run, uri=elsewhere)
    assert got["history"]["train/loss"] == fed.expected["train/loss"] and got["info"]["name"] == "run"


def test_a_failed_fit_ends_the_run_failed(fed, tmp_path, local):
    fed.feed(Mlflow(MlflowConfig(), tmp_path, fed.config), crash_after=3)
    got = fed.readers["mlflow"](tmp_path)
    assert got["info"]["status"] == "FAILED" and got["history"]["train/loss"] == [(2, 0.5)]
