"""``rankwise merge INPUTS... --method M --weights W --out DIR`` (or ``--config FILE`` with a
``rule:`` section): combine LoRA adapters of one base into one PEFT adapter (the work:
:mod:`rankwise.commands.merge.run`, the maths :mod:`rankwise.commands.merge.combine`, the rules
of registry kind ``merge-rule`` :mod:`rankwise.commands.merge.rules`; docs/merge.md)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry
from rankwise.commands.merge.config import MergeConfig, merge_config, parse_weights
from rankwise.commands.options import write_config
from rankwise.errors import RankwiseError


@click.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--config", "config", type=click.Path(path_type=Path), default=None,
              help="A YAML file: rule: {name: ties, density: 0.5}, weights: [...], seed: N (the flags override it).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override one setting, e.g. --set rule.density=0.3 (after --config, before the flags).")
@click.option("--method", default=None, metavar="linear|cat|svd|ties|dare-ties|dare-linear",
              help="rule.name: the merge rule (required without --config).")
@click.option("--weights", default=None, metavar="W1,W2,...", help="weights: one weight per adapter.")
@click.option("--density", type=float, default=None, help="rule.density: fraction kept by ties / dare-*, in (0, 1].")
@click.option("--seed", type=int, default=None, help="seed: seeds the DARE masks.")
@click.option("--rank", "svd_rank", type=int, default=None, help="rule.rank: rank of an svd merge (default: the largest).")
@click.option("--majority-sign", default=None, metavar="total|frequency",
              help="rule.sign_method: sign election of ties / dare-ties.")
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--merged", is_flag=True, help="Also write the base with the result folded in, OUT/merged.")
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="The base model's folder, instead of the one the inputs record.")
def merge(inputs: tuple[Path, ...], config: Path | None, sets: tuple[str, ...], method: str | None,
          weights: str | None, out: Path, merged: bool, model_path: Path | None, **flags) -> None:
    """Combine LoRA adapters of one base (runs or PEFT folders) into one PEFT adapter."""
    from rankwise.commands.merge.run import merge_sources
    if method is None and config is None and not any(s.startswith("rule.name=") for s in sets):
        raise RankwiseError("pass --method linear|cat|svd|ties|dare-ties|dare-linear (or rule: {name: ...} "
                            "in --config FILE)")
    flags["method"] = method.replace("_", "-") if method is not None else None  # PEFT's dare_ties
    flags["weights"] = parse_weights(weights) if weights is not None else None
    cfg = merge_config(config, sets, flags)
    click.echo(f"wrote {merge_sources(list(inputs), cfg, out, merged, model_path)}")


def example(folder: Path) -> list[str]:
    """A linear merge of ``folder/a`` and ``folder/b`` into ``folder/out``, its rule and weights
    in ``folder/config.yaml``."""
    config = write_config(folder, {"rule": {"name": "linear"}, "weights": [1.0, 1.0]})
    return [str(folder / "a"), str(folder / "b"), "--config", str(config), "--out", str(folder / "out")]


registry.register("command", "merge", MergeConfig, merge, summary="combine LoRA adapters of one base into one",
                  writes="merge", example=example)
