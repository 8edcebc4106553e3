"""``rankwise continual CONFIG --tasks ...``: tasks learned one after another, one LoRA module per
task (HRM-PET; the work: :mod:`rankwise.commands.continual.run`; docs/continual.md)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry
from rankwise.commands.options import set_option, write_config
from rankwise.commands.continual.run import ContinualConfig


@click.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--tasks", required=True, help="Classes by ',' and tasks by '/': asyncio,email/http,importlib")
@set_option
@click.option("--method", default=None, help="hrm-pet, key-match, sequential or joint (overrides the config).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write the record here (JSON).")
def continual(config: Path, tasks: str, sets: tuple[str, ...], method: str | None, out: Path | None) -> None:
    """Learn tasks one after another, one LoRA module per task (HRM-PET; docs/continual.md)."""
    from rankwise.commands.continual.run import continual_command
    continual_command(config, tasks, method, out, sets)


def example(folder: Path) -> list[str]:
    """Two tasks of the demo's packages on the tiny BERT, one step each."""
    config = write_config(folder, {"model": "tiny-bert", "steps_per_task": 1})
    return [str(config), "--tasks", "asyncio,email/http,importlib"]


registry.register("command", "continual", ContinualConfig, continual, summary="learn tasks one after another (HRM-PET)", example=example)
