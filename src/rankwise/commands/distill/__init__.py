"""``rankwise distill TEACHER --student-hidden H --out DIR``: Low-Rank Clone distillation (the
work: :mod:`rankwise.commands.distill.run`, the model :mod:`rankwise.compress.clone`; docs/distill.md)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry


@click.command()
@click.argument("teacher", type=click.Path(path_type=Path))
@click.option("--student-hidden", type=int, default=None, help="The student's hidden size (below the teacher's).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Output folder (model/ is the student).")
@click.option("--config", "config", type=click.Path(path_type=Path), default=None,
              help="YAML with DistillConfig keys (steps, temperature, data, ...).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a config key (YAML value).")
@click.option("--resume", is_flag=True, help="Continue from the folder's last checkpoint.")
def distill(teacher: Path, student_hidden: int | None, out: Path, config: Path | None, sets: tuple[str, ...],
            resume: bool) -> None:
    """Low-Rank Clone: distill TEACHER (model or run folder) into a narrower plain Llama (docs/distill.md)."""
    from rich.console import Console

    from rankwise.commands.distill.run import read_config, run_distill
    m = run_distill(teacher, out, read_config(config, list(sets), student_hidden), resume,
                    Console(stderr=True))
    click.echo(f"student {m['student_params']:,} params (teacher {m['teacher_params']:,}): held-out perplexity "
               f"{m['student_eval_perplexity']:.3f} (teacher {m['teacher_eval_perplexity']:.3f})")
    click.echo(f"wrote {out}/model")


def example(folder: Path) -> list[str]:
    """``folder/teacher`` into a student of width 16 in ``folder/out``."""
    return [str(folder / "teacher"), "--student-hidden", "16", "--out", str(folder / "out")]


registry.register("command", "distill", None, distill, summary="Low-Rank Clone: distill a model into a narrower Llama", writes="distill", example=example)
