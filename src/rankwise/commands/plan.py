"""``rankwise plan CONFIG``: a config's peak memory before it runs (the work:
:mod:`rankwise.recipes.planner`, which ``train`` also uses to report its prediction beside the
measured peak; docs/plan.md)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry
from rankwise.commands.options import write_config
from rankwise.recipes.config import RunConfig


@click.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a config key (YAML value).")
@click.option("--memory", default=None, metavar="SIZE", help="Budget, e.g. 24GiB or 80GB.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cuda", show_default=True)
@click.option("--fit", is_flag=True, help="Propose the cheapest switches that fit --memory.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (peak_mb in MiB).")
@click.option("--padded", is_flag=True, help="Batches carry padding (the attention gets a mask).")
@click.option("--nproc", type=int, default=1, show_default=True,
              help="torchrun processes: predict one process's peak under train.distributed.")
def plan(config: Path, sets: tuple[str, ...], memory: str | None, device: str, fit: bool,
         as_json: bool, padded: bool, nproc: int) -> None:
    """Predict a config's peak memory before it runs (meta device: no weights are read)."""
    import json

    from rankwise.recipes.planner import plan as run_plan
    obj, text, _ = run_plan(config, list(sets), memory, device, fit, padded, nproc)
    click.echo(json.dumps(obj) if as_json else text)


def example(folder: Path) -> list[str]:
    """The tiny Llama's plan on the CPU."""
    config = write_config(folder, {"model": {"path": "tiny-llama"}})
    return [str(config), "--device", "cpu"]


registry.register("command", "plan", RunConfig, plan, summary="predict a config's peak memory before it runs", example=example)
