"""``rankwise merge INPUTS... --method M --weights W --out DIR``: combine LoRA adapters of one
base into one PEFT adapter (the work: :mod:`rankwise.commands.merge.run`, the maths
:mod:`rankwise.commands.merge.combine`; docs/merge.md)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry


@click.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--method", required=True, metavar="linear|cat|svd|ties|dare-ties|dare-linear")
@click.option("--weights", required=True, metavar="W1,W2,...", help="One weight per adapter.")
@click.option("--density", type=float, default=None, help="Fraction kept by ties / dare-*, in (0, 1].")
@click.option("--seed", type=int, default=None, help="Seeds the DARE masks.")
@click.option("--rank", "svd_rank", type=int, default=None, help="Rank of an svd merge (default: the largest).")
@click.option("--majority-sign", default=None, metavar="total|frequency", help="Sign election of ties / dare-ties.")
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--merged", is_flag=True, help="Also write the base with the result folded in, OUT/merged.")
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="The base model's folder, instead of the one the inputs record.")
def merge(inputs: tuple[Path, ...], method: str, weights: str, density: float | None, seed: int | None,
          svd_rank: int | None, majority_sign: str | None, out: Path, merged: bool,
          model_path: Path | None) -> None:
    """Combine LoRA adapters of one base (runs or PEFT folders) into one PEFT adapter."""
    from rankwise.commands.merge.run import MergeConfig, merge_sources, parse_weights
    given = {"density": density, "seed": seed, "svd_rank": svd_rank, "majority_sign": majority_sign}
    cfg = MergeConfig(method=method.replace("-", "_"), weights=parse_weights(weights),
                      **{k: v for k, v in given.items() if v is not None})
    click.echo(f"wrote {merge_sources(list(inputs), cfg, out, merged, model_path)}")


def example(folder: Path) -> list[str]:
    """A linear merge of ``folder/a`` and ``folder/b`` into ``folder/out``."""
    return [str(folder / "a"), str(folder / "b"), "--method", "linear", "--weights", "1,1",
            "--out", str(folder / "out")]


registry.register("command", "merge", None, merge, summary="combine LoRA adapters of one base into one",
                  writes="merge", example=example)
