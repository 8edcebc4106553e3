"""``rankwise distill CONFIG [--set ...] [--out DIR]``: Low-Rank Clone distillation (the
work: :mod:`rankwise.commands.distill.run`, the model :mod:`rankwise.compress.clone`; docs/distill.md)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry
from rankwise.commands.options import set_option, write_config
from rankwise.compress.clone import DistillConfig


@click.command()
@click.argument("source", metavar="CONFIG", type=click.Path(path_type=Path))
@set_option
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Output folder, model/ is the student (default runs/<name>-distill).")
@click.option("--student-hidden", type=int, default=None, help="The student's hidden size (below the teacher's).")
@click.option("--config", "config", type=click.Path(path_type=Path), default=None,
              help="The old spelling (distill TEACHER --config FILE): YAML with DistillConfig keys.")
@click.option("--resume", is_flag=True, help="Continue from the folder's last checkpoint.")
def distill(source: Path, sets: tuple[str, ...], out: Path | None, student_hidden: int | None,
            config: Path | None, resume: bool) -> None:
    """Low-Rank Clone: distill CONFIG's teacher (model or run folder) into a narrower plain Llama
    (docs/distill.md). CONFIG holds teacher: and the distill keys; the old spelling, TEACHER
    --out DIR [--config FILE], is read until the next release."""
    from rich.console import Console

    from rankwise.commands.distill.run import read_command, run_distill
    teacher, cfg, out = read_command(source, config, list(sets), student_hidden, out)
    m = run_distill(teacher, out, cfg, resume, Console(stderr=True))
    click.echo(f"student {m['student_params']:,} params (teacher {m['teacher_params']:,}): held-out perplexity "
               f"{m['student_eval_perplexity']:.3f} (teacher {m['teacher_eval_perplexity']:.3f})")
    click.echo(f"wrote {out}/model")


def example(folder: Path) -> list[str]:
    """``folder/teacher`` into a student of width 16 in ``folder/out``."""
    config = write_config(folder, {"teacher": "teacher", "student_hidden": 16, "steps": 1})
    return [str(config), "--out", str(folder / "out")]


registry.register("command", "distill", DistillConfig, distill,
                  summary="Low-Rank Clone: distill a model into a narrower Llama", writes="distill",
                  example=example)
