"""``rankwise.train``: a whole ``rankwise train`` run from Python.

The same run as the CLI (validation, run folder, checkpoints, resume, torchrun), from a dict, a
YAML path or a :class:`~rankwise.recipes.config.RunConfig`; it returns the metrics that
``metrics.json`` holds. GRPO rewards may be Python callables in ``task.rewards``, as TRL's
``GRPOTrainer(reward_funcs=[fn])`` (:func:`rankwise.tasks.grpo.rewards.name_callables`).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from rankwise.errors import RankwiseError


def load_config(config: Any, sets: list[str] | None = None):
    """A validated :class:`~rankwise.recipes.config.RunConfig`.

    Args:
        config: A dict (the YAML file's sections), a YAML path, or a ``RunConfig`` (checked again).
        sets: ``--set`` overrides, ``["train.steps=100", ...]``.

    Returns:
        The config; callables in ``task.rewards`` are replaced by their names.

    Raises:
        RankwiseError: Every problem of the config at once, or a ``config`` of another type.
    """
    from rankwise.recipes.config import RunConfig, load_run_config, read_yaml
    from rankwise.tasks.grpo.rewards import name_callables
    path = None
    if isinstance(config, RunConfig):
        raw = config.to_dict()
    elif isinstance(config, (str, Path)):
        path, raw = Path(config), read_yaml(Path(config))
    elif isinstance(config, dict):
        raw = copy.deepcopy(config)  # functions are copied by reference
    else:
        raise RankwiseError(f"rankwise.train: config must be a dict, a YAML path or a RunConfig; got "
                            f"{type(config).__name__}")
    for section in (raw.get("task"), raw.get("grpo")):  # (grpo: the old spelling of task)
        if isinstance(section, dict) and isinstance(section.get("rewards"), (list, tuple)):
            section["rewards"] = name_callables(list(section["rewards"]))
    cfg = load_run_config(None, sets, base=raw)
    if path is not None:
        cfg.task.read_from(path.expanduser().resolve().parent)  # as the CLI reads a file
    return cfg


def train(config: Any, out: str | Path, *, resume: bool = False, sets: list[str] | None = None,
          console: Any = None) -> dict:
    """Run ``rankwise train`` from Python and return its metrics.

    Args:
        config: A dict, a YAML path or a ``RunConfig`` (:func:`load_config`); ``task.rewards``
            may hold callables ``fn(prompts, completions, **columns) -> list[float]``.
        out: The run folder (the CLI's ``--out``).
        resume: Continue the run in ``out`` from its last checkpoint (``--resume``).
        sets: ``--set`` overrides.
        console: A ``rich.console.Console`` for messages (default: stderr).

    Returns:
        The metrics written to ``out/metrics.json`` (for a finished run resumed with the same
        ``train.steps``, the ones it wrote).

    Raises:
        RankwiseError: A bad config, a run folder conflict, a non-finite loss (as the CLI's
            one-line errors).
        KeyboardInterrupt: After writing a checkpoint, on Ctrl-C.
    """
    from rankwise.recipes.train import RunFinished
    from rankwise.recipes.train import train as run_train
    cfg = load_config(config, sets)
    try:
        return run_train(cfg, Path(out), resume=resume, console=console)
    except RunFinished:
        return json.loads((Path(out) / "metrics.json").read_text())


__all__ = ["load_config", "train"]
