"""Experiment trackers, registered as kind ``tracker`` (``train.log_to``).

Importing this package registers ``tensorboard``, ``wandb`` and ``mlflow``; each is one module
here (its config dataclass and a :class:`~rankwise.trackers.common.Tracker` subclass) with ONE
``registry.register("tracker", ...)`` below. An entry of ``train.log_to`` is a name
(``wandb``) or a mapping ``{name: wandb, project: ..., ...}`` overriding that tracker's config.
The train recipe resolves the entries (:func:`resolve`), checks their packages before anything
runs (:func:`check_installed`) and adds the trackers as callbacks on the first process only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.errors import RankwiseError, require
from rankwise.trackers.common import Tracker, TrackerConfig
from rankwise.trackers.mlflow import Mlflow, MlflowConfig
from rankwise.trackers.tensorboard import TensorBoard, TensorBoardConfig
from rankwise.trackers.wandb import Wandb, WandbConfig

registry.register("tracker", "tensorboard", TensorBoardConfig, TensorBoard,
                  "TensorBoard event files in RUN_DIR/tensorboard")
registry.register("tracker", "wandb", WandbConfig, Wandb,
                  "Weights & Biases; an offline run in RUN_DIR/wandb unless WANDB_MODE / mode says")
registry.register("tracker", "mlflow", MlflowConfig, Mlflow,
                  "MLflow; the file store RUN_DIR/mlruns unless MLFLOW_TRACKING_URI / tracking_uri says")


def resolve(entries: list[Any], where: str = "log_to") -> tuple[list[TrackerConfig], list[str]]:
    """Turn ``train.log_to`` entries into the trackers' config dataclasses.

    Args:
        entries: Names, ``{name: ..., <option>: ...}`` mappings, or configs already built.
        where: The prefix of messages (``log_to``; each entry adds ``[i]``).

    Returns:
        ``(configs, problems)``: the configs of the entries that are valid, and one message per
        problem (unknown tracker, unknown key, bad value, a tracker listed twice).
    """
    configs: list[TrackerConfig] = []
    problems: list[str] = []
    for i, entry in enumerate(entries):
        at = f"{where}[{i}]"
        if isinstance(entry, TrackerConfig):
            configs.append(entry)
            continue
        raw = {"name": entry} if isinstance(entry, str) else dict(entry) if isinstance(entry, dict) else None
        if raw is None or not isinstance(raw.get("name"), str):
            problems.append(f"{at}: got {entry!r}; expected a tracker name or {{name: ..., ...}}")
            continue
        try:
            cls = registry.get("tracker", raw["name"]).config_cls
            configs.append(from_dict(cls, raw, at))
        except RankwiseError as err:
            problems.append(str(err) if str(err).startswith(at) else f"{at}: {err}")
    names = [c.name for c in configs]
    problems += [f"{where}: {n} is listed twice; keep one entry" for n in sorted(set(names))
                 if names.count(n) > 1]
    return configs, problems


def check_installed(configs: list[TrackerConfig]) -> None:
    """Check that every configured tracker's package is installed, before anything runs.

    Raises:
        RankwiseError: One line naming ``pip install 'rankwise[EXTRA]'`` for the first missing one.
    """
    for cfg in configs:
        cls = registry.get("tracker", cfg.name).builder
        if cls.module:
            require(cls.module, cls.extra, f"train.log_to: {cfg.name}")


def build(configs: list[TrackerConfig], folder: Path, run_config: dict, every: int = 1,
          console: Any = None) -> list[Tracker]:
    """The tracker callbacks of ``configs`` (see :class:`~rankwise.trackers.common.Tracker`).

    Args:
        configs: Resolved ``train.log_to`` entries.
        folder: The run folder.
        run_config: The resolved run config as a dict.
        every: ``train.log_every``.
        console: Where each tracker's one line goes.
    """
    return [registry.get("tracker", c.name).builder(c, folder, run_config, every, console)
            for c in configs]


__all__ = ["Tracker", "TrackerConfig", "TensorBoardConfig", "WandbConfig", "MlflowConfig",
           "resolve", "check_installed", "build"]
