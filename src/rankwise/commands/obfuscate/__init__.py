"""``rankwise obfuscate MODEL --out DIR``: publish a model under a rank-d additive mask, the
factors apart (the work: :mod:`rankwise.commands.obfuscate.run`, the maths :mod:`rankwise.obfuscation`;
docs/loro.md)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The published model folder (new or empty).")
@click.option("--rank", type=int, default=None, help="Rank d of each layer's mask (default: ObfuscateConfig's).")
@click.option("--cornerstones", type=int, default=None, help="Cornerstone factors k shared by all layers.")
@click.option("--factors", type=click.Path(path_type=Path), default=None,
              help="The secret factors file (default DIR.factors.safetensors beside --out; never inside it).")
@click.option("--seed", type=int, default=None, help="Seed of the masks (secret; default: drawn from the OS).")
def obfuscate(model: Path, out: Path, rank: int | None, cornerstones: int | None, factors: Path | None,
              seed: int | None) -> None:
    """Publish MODEL under a rank-d additive mask (LoRO-like; W' = W + BA); the factors go to a
    separate file. A rank-d SVD of W' minus the public pretrained weights removes this mask
    (bench loro, docs/loro.md): it is not the paper's LoRO, whose construction we could not read."""
    from rankwise.obfuscation import ObfuscateConfig
    from rankwise.commands.obfuscate.run import run_obfuscate
    given = {"rank": rank, "cornerstones": cornerstones, "seed": seed}
    report = run_obfuscate(model, out, ObfuscateConfig(**{k: v for k, v in given.items() if v is not None}), factors)
    click.echo(f"masked {report['layers']} layers at rank {report['rank']} with {report['cornerstones']} "
               f"cornerstones; trusted side {report['factor_bytes'] / 2**20:.3f} MiB = "
               f"{report['factor_fraction_of_model']:.2%} of the model's {report['model_bytes'] / 2**20:.1f} MiB "
               f"(one mask pair per layer: {report['unshared_factor_bytes'] / 2**20:.3f} MiB)")
    click.echo(f"wrote {report['out']} and {report['factors_path']}")


def example(folder: Path) -> list[str]:
    """``folder/model`` (a model folder's config.json) published into ``folder/out``."""
    model = Path(folder) / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    return [str(model), "--out", str(folder / "out")]


registry.register("command", "obfuscate", None, obfuscate, summary="publish a model under a rank-d additive mask (LoRO-like)", writes="model", example=example)
