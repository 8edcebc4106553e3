"""``rankwise federated CONFIG``: federated fine-tuning on Flower's simulation engine (the work:
:mod:`rankwise.federated.run`)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry
from rankwise.commands.options import config_argument, default_out, set_option, write_config
from rankwise.errors import require
from rankwise.recipes.config import RunConfig


@click.command()
@config_argument
@set_option
@click.option("--out", type=click.Path(path_type=Path), default=None)
@click.option("--resume", is_flag=True, help="Continue the run in --out from its newest round checkpoint.")
def federated(config: Path, sets: tuple[str, ...], out: Path | None, resume: bool) -> None:
    """Federated fine-tuning on the Flower simulation engine."""
    require("flwr", "federated", "rankwise federated")
    from rankwise.federated.run import run_federated
    run_federated(config, list(sets), out or default_out(config, "federated"), resume=resume)


def example(folder: Path) -> list[str]:
    """Two clients, one round on the tiny BERT classifier."""
    config = write_config(folder, {"model": {"path": "tiny-bert"},
                                   "federated": {"clients": 2, "rounds": 1}})
    return [str(config), "--out", str(folder / "out")]


registry.register("command", "federated", RunConfig, federated,
                  summary="federated fine-tuning on the Flower simulation engine",
                  writes="federated", example=example)
