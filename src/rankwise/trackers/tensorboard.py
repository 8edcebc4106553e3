"""TensorBoard (``train.log_to: [tensorboard]``): event files in ``RUN_DIR/tensorboard``.

Scalars as the other trackers log them (``train/loss``, ``train/lr``, ``eval/<metric>``), the
run config as the text ``config`` (YAML), and the final metrics as ``final/<name>`` scalars at
the last step. A resumed run purges the events past its checkpoint's step, so the curves equal an
uninterrupted run's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rankwise.trackers.common import Tracker, TrackerConfig, is_number


@dataclass
class TensorBoardConfig(TrackerConfig):
    """TensorBoard's entry of ``train.log_to`` (no settings: the folder is ``RUN_DIR/tensorboard``).

    Attributes:
        name: ``tensorboard``.
    """

    name: str = "tensorboard"


class TensorBoard(Tracker):
    """Write scalars with ``torch.utils.tensorboard.SummaryWriter`` (see the module docstring)."""

    module = "tensorboard"
    extra = "tensorboard"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._writer: Any = None
        self._last_step = 0

    def open(self, start_step: int) -> str:
        import yaml
        from torch.utils.tensorboard import SummaryWriter
        folder = self.folder / "tensorboard"
        self._writer = SummaryWriter(str(folder), purge_step=start_step + 1 if start_step else None)
        self._writer.add_text("config", "```yaml\n" + yaml.safe_dump(self.run_config, sort_keys=False)
                              + "```", start_step)
        return f"tensorboard: writing to {folder} (view: tensorboard --logdir {folder})"

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)
        self._last_step = step

    def log_final(self, metrics: dict[str, Any]) -> None:
        step = int(metrics.get("steps", self._last_step))
        for name, value in metrics.items():
            if is_number(value):
                self._writer.add_scalar(f"final/{name}", value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self, ok: bool) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


__all__ = ["TensorBoardConfig", "TensorBoard"]
