"""``rankwise select CONFIG``: score the training records by ``data.select`` and write the chosen
ids (the work: :mod:`rankwise.commands.select.run`, the stage
:mod:`rankwise.recipes.select`; docs/select.md)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry
from rankwise.commands.options import write_config
from rankwise.recipes.config import RunConfig


@click.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a config key (YAML value).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder for scores.jsonl, chosen.json.")
def select(config: Path, sets: tuple[str, ...], out: Path) -> None:
    """Score the training records by the rule of data.select (random, embedding, less,
    influence, qcs-proxy: a proxy of QCS; rankwise list shows every select-rule) and write the
    chosen ids (docs/select.md)."""
    from rankwise.commands.select.run import run_select
    run_select(config, list(sets), out)


def example(folder: Path) -> list[str]:
    """Random selection of half the tiny BERT run's records."""
    config = write_config(folder, {"model": {"path": "tiny-bert"},
                                   "data": {"select": {"name": "random", "budget": 0.5}}})
    return [str(config), "--out", str(folder / "out")]


registry.register("command", "select", RunConfig, select, summary="score the training records and write the chosen ids", writes="select", example=example)
