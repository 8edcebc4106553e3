"""``rankwise demo``: frozen MiniLM + head against LoRA on the packaged docstring topic task
(the work: :mod:`rankwise.commands.demo.run`)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True)
@click.option("--steps", type=int, default=None, help="Training steps per method (default: the demo's).")
def demo(out: Path, steps: int | None) -> None:
    """Frozen MiniLM + head vs LoRA on the stdlib-docstring topic task."""
    from rankwise.commands.demo.run import run_demo
    run_demo(out, steps=steps)


def example(folder: Path) -> list[str]:
    """The demo into ``folder/out``."""
    return ["--out", str(folder / "out"), "--steps", "1"]


registry.register("command", "demo", None, demo, summary="frozen MiniLM + head vs LoRA on the packaged task", writes="demo", example=example)
