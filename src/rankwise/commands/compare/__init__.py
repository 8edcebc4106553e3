"""``rankwise compare CONFIG --methods ...``: several methods on one task at one budget, tabulated
(the work: :mod:`rankwise.commands.compare.run`)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry
from rankwise.commands.options import write_config
from rankwise.recipes.config import RunConfig


@click.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--methods", default="lora,gora,altlora", show_default=True, help="Comma-separated rows: METHOD or METHOD+OPTIMIZER (lora,gora,gora+altlora,full+galore).")
@click.option("--seeds", type=int, default=3, show_default=True)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/compare"), show_default=True)
@click.option("--lr-grid", type=int, default=0, show_default=True,
              help="Sweep every row over this many learning rates on a validation split; 0 = off.")
@click.option("--jobs", type=int, default=1, show_default=True,
              help="Runs trained at once, each in its own process (CPU threads divided among them; one GPU each).")
def compare(config: Path, methods: str, seeds: int, sets: tuple[str, ...], out: Path, lr_grid: int,
            jobs: int) -> None:
    """Run several methods on one task at the same budget and tabulate the results."""
    from rankwise.commands.compare.run import run_compare
    run_compare(config, [m.strip() for m in methods.split(",") if m.strip()], seeds, list(sets), out,
                lr_grid=lr_grid, jobs=jobs)


def example(folder: Path) -> list[str]:
    """Two rows, one seed, one step each on the tiny BERT classifier."""
    config = write_config(folder, {"model": {"path": "tiny-bert"}, "train": {"steps": 1}})
    return [str(config), "--methods", "lora,full", "--seeds", "1", "--out", str(folder / "out")]


registry.register("command", "compare", RunConfig, compare, summary="several methods on one task at one budget, tabulated", writes="compare", example=example)
