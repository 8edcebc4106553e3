"""``rankwise vfl CONFIG``: two-party vertical federated learning (the work:
:mod:`rankwise.federated.vfl.run`). A verb of its own beside ``federated``: its config has one
section, ``vfl:``, and no model, data or method of a run (docs/vfl.md)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry
from rankwise.commands.options import config_argument, default_out, set_option, write_config
from rankwise.errors import require
from rankwise.federated.vfl.config import VFLConfig


@click.command()
@config_argument
@set_option
@click.option("--out", type=click.Path(path_type=Path), default=None)
def vfl(config: Path, sets: tuple[str, ...], out: Path | None) -> None:
    """Two-party vertical federated learning: synchronous split learning or PubSub-VFL."""
    require("flwr", "federated", "rankwise vfl")
    from rankwise.federated.vfl.run import run_vfl
    m = run_vfl(config, list(sets), out or default_out(config, "vfl"))
    click.echo(f"final accuracy {m['final_accuracy']:.4f}, {m['train_bytes']} bytes crossed, {m['wall_s']:.2f} s")


def example(folder: Path) -> list[str]:
    """The default vfl config."""
    return [str(write_config(folder, {"vfl": {}})), "--out", str(folder / "out")]


registry.register("command", "vfl", VFLConfig, vfl, summary="two-party vertical federated learning",
                  writes="vfl", example=example)
