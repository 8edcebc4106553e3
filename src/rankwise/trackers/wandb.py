"""Weights & Biases (``train.log_to: [wandb]``): an offline run in ``RUN_DIR/wandb`` by default.

Nothing leaves the machine unless the user asks: the mode is ``offline`` unless the entry's
``mode`` or ``WANDB_MODE`` says otherwise, and an offline run also turns W&B's own error
reporting off (``WANDB_ERROR_REPORTING``, unless the user set it). ``wandb sync
RUN_DIR/wandb/offline-run-...`` uploads the run later. The run config is the W&B run's
config, the scalars its history (``step`` = the optimizer step), the final metrics its summary.
W&B's console capture is off (rankwise's progress bar stays as it is) and so is its own banner:
one line says where the run is. A resumed rankwise run starts a new W&B run; W&B's own
``WANDB_RUN_ID`` + ``WANDB_RESUME=allow`` continue one instead.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from rankwise.trackers.common import Tracker, TrackerConfig


@dataclass
class WandbConfig(TrackerConfig):
    """W&B's entry of ``train.log_to`` (``wandb`` or ``{name: wandb, project: ..., ...}``).

    Attributes:
        name: ``wandb``.
        project: The W&B project.
        run_name: The run's display name; ``null``: the run folder's name.
        tags: Tags of the run.
        entity: The W&B entity (user or team); ``null``: W&B's default.
        group: Groups runs in the W&B UI (a sweep, a comparison); ``null``: none.
        mode: ``offline`` (files only), ``online`` (uploads while training; needs a login) or
            ``disabled``; ``null``: ``WANDB_MODE`` when set, else ``offline``.
    """

    name: str = "wandb"
    project: str = "rankwise"
    run_name: Union[str, None] = None
    tags: list[str] = field(default_factory=list)
    entity: Union[str, None] = None
    group: Union[str, None] = None
    mode: Union[Literal["offline", "online", "disabled"], None] = None

    def resolved_mode(self) -> str:
        """The mode in force: :attr:`mode`, else ``WANDB_MODE``, else ``offline``."""
        return self.mode or os.environ.get("WANDB_MODE") or "offline"


class Wandb(Tracker):
    """Log to a W&B run (see the module docstring)."""

    module = "wandb"
    extra = "wandb"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._run: Any = None

    def open(self, start_step: int) -> str:
        cfg, mode = self.config, self.config.resolved_mode()
        if mode != "online":
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # before the service starts
        import wandb
        settings = wandb.Settings(console="off", silent=True, save_code=False)
        self._run = wandb.init(project=cfg.project, entity=cfg.entity, group=cfg.group,
                               name=cfg.run_name or self.folder.name, tags=list(cfg.tags),
                               config=self.run_config, dir=str(self.folder), mode=mode,
                               job_type="train", settings=settings)
        if mode == "disabled":
            return "wandb: disabled (mode: disabled)"
        if mode == "offline":
            run_dir = Path(self._run.dir).parent
            return f"wandb: offline run in {run_dir} (upload: wandb sync {run_dir})"
        return f"wandb: {self._run.url}"

    def log(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def log_final(self, metrics: dict[str, Any]) -> None:
        self._run.summary.update(metrics)

    def close(self, ok: bool) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if ok else 1)
            self._run = None


__all__ = ["WandbConfig", "Wandb"]
