"""``rankwise inspect RUN_OR_MODEL``: gradient rank, Model Shapley and the low-rank inverse bound
(the work: :mod:`rankwise.commands.inspect.run`; docs/inspect.md)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry
from rankwise.commands.options import default_out


@click.command()
@click.argument("target", metavar="RUN_OR_MODEL", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="Run config whose data: gives the calibration batches (default: the run's own).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Output folder (default runs/<name>-inspect).")
def inspect(target: Path, data: Path | None, out: Path | None) -> None:
    """Gradient rank, Model Shapley and the low-rank inverse bound of a run or model (docs/inspect.md)."""
    from rankwise.commands.inspect.run import run_inspect
    out = out or default_out(target, "inspect")
    run_inspect(target, data, out)
    click.echo(f"wrote {out}/report.md and {out}/inspect.json")


def example(folder: Path) -> list[str]:
    """The tiny Llama's report into ``folder/out``."""
    return ["tiny-llama", "--out", str(folder / "out")]


registry.register("command", "inspect", None, inspect, summary="gradient rank, Model Shapley and the low-rank bound of a run", writes="inspect", example=example)
