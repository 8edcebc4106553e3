"""``rankwise compress CONFIG``: prune, factor or quantize a model as the config's ``compress:``
section says (the work: :mod:`rankwise.recipes.compress`, shared with ``distill``'s token
windows; the compressors: :mod:`rankwise.compress`)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry
from rankwise.commands.options import write_config
from rankwise.recipes.config import RunConfig


@click.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a config key (YAML value).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Output folder (default runs/<name>-compressed).")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output folder.")
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="When model.path is a run: its base model's folder, if it has moved.")
def compress(config: Path, sets: tuple[str, ...], out: Path | None, overwrite: bool,
             model_path: Path | None) -> None:
    """Compress a model (prune, factor, quantize) as CONFIG's compress: section says."""
    from rich.console import Console

    from rankwise.recipes.compress import run_compress
    out = out or Path("runs") / f"{config.stem}-compressed"
    run_compress(config, list(sets), out, overwrite=overwrite, console=Console(stderr=True),
                 model_path=model_path)
    click.echo(f"wrote {out}")


def example(folder: Path) -> list[str]:
    """Magnitude pruning of the tiny Llama."""
    config = write_config(folder, {"model": {"path": "tiny-llama"},
                                   "compress": {"method": "magnitude", "sparsity": 0.5}})
    return [str(config), "--out", str(folder / "out")]


registry.register("command", "compress", RunConfig, compress, summary="compress a model (prune, factor, quantize)", writes="compress", example=example)
