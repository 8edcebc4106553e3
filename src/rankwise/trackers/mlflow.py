"""MLflow (``train.log_to: [mlflow]``): a local store in ``RUN_DIR/mlruns`` by default.

The tracking URI is the entry's ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else the file
store ``file:RUN_DIR/mlruns``: nothing contacts a server unless the user names one. MLflow 3
keeps its file store in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``, which rankwise sets
for that default (unless the user set it); its anonymous usage telemetry is off
(``MLFLOW_DISABLE_TELEMETRY``, unless the user set it). The run config is logged as flattened
params (``train.lr``) and as the artifact ``config.yaml``; scalars as metrics (``step`` = the
optimizer step); the final metrics as metrics at the last step (numbers), tags (strings) and
the artifact ``metrics.json``. ``mlflow-skinny`` is enough to write and read the store; its UI
comes with the full ``mlflow`` package.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Union

from rankwise.trackers.common import Tracker, TrackerConfig, flatten, is_number

PARAM_CHARS = 6000  # MLflow's longest param value
BATCH = 100  # params per log_batch call (MLflow's limit)


@dataclass
class MlflowConfig(TrackerConfig):
    """MLflow's entry of ``train.log_to`` (``mlflow`` or ``{name: mlflow, experiment: ..., ...}``).

    Attributes:
        name: ``mlflow``.
        experiment: The MLflow experiment (created when missing).
        run_name: The run's name; ``null``: the run folder's name.
        tags: Tags of the run, ``{key: value}``.
        tracking_uri: Where runs go; ``null``: ``MLFLOW_TRACKING_URI`` when set, else the file
            store ``file:RUN_DIR/mlruns``.
    """

    name: str = "mlflow"
    experiment: str = "rankwise"
    run_name: Union[str, None] = None
    tags: dict[str, str] = field(default_factory=dict)
    tracking_uri: Union[str, None] = None


class Mlflow(Tracker):
    """Log to an MLflow run through ``MlflowClient`` (see the module docstring)."""

    module = "mlflow"
    extra = "mlflow"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._client: Any = None
        self.run_id: str | None = None
        self._last_step = 0

    def tracking_uri(self) -> str:
        """The URI in force (see :class:`MlflowConfig`)."""
        return (self.config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                or (self.folder / "mlruns").resolve().as_uri())

    def open(self, start_step: int) -> str:
        import yaml
        uri = self.tracking_uri()
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before mlflow is imported
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        client = self._client = MlflowClient(tracking_uri=uri)
        cfg = self.config
        exp = client.get_experiment_by_name(cfg.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(cfg.experiment)
        run = client.create_run(exp_id, run_name=cfg.run_name or self.folder.name,
                                tags={str(k): str(v) for k, v in cfg.tags.items()})
        self.run_id = run.info.run_id
        params = [Param(k, str(v)[:PARAM_CHARS]) for k, v in flatten(self.run_config).items()]
        for i in range(0, len(params), BATCH):
            client.log_batch(self.run_id, params=params[i:i + BATCH])
        client.log_text(self.run_id, yaml.safe_dump(self.run_config, sort_keys=False), "config.yaml")
        view = "MLFLOW_ALLOW_FILE_STORE=true mlflow ui" if uri.startswith("file:") else "mlflow ui"
        return f"mlflow: run {self.run_id} in {uri} (view: {view} --backend-store-uri {uri})"

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])
        self._last_step = step

    def log_final(self, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag
        now, step = int(time.time() * 1000), int(metrics.get("steps", self._last_step))
        self._client.log_batch(
            self.run_id,
            metrics=[Metric(k, float(v), now, step) for k, v in metrics.items() if is_number(v)],
            tags=[RunTag(k, str(v)) for k, v in metrics.items() if isinstance(v, str)])
        self._client.log_dict(self.run_id, metrics, "metrics.json")

    def close(self, ok: bool) -> None:
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")
            self._client = None


__all__ = ["MlflowConfig", "Mlflow"]
