"""``rankwise transfer RUN --to NEW_BASE --out DIR``: move a LoRA run onto an upgraded base
model (LoRASuite; the work: :mod:`rankwise.commands.transfer.run`, the maths
:mod:`rankwise.commands.transfer.lorasuite`; docs/transfer.md)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry


@click.command()
@click.argument("run_dir", metavar="RUN", type=click.Path(path_type=Path))
@click.option("--to", "new_base", required=True, metavar="NEW_BASE", help="The new base model's folder.")
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--finetune-steps", type=int, default=None,
              help="Steps of the run's training after the transfer (LoRASuite's fine-tune stage); "
                   "0 (the default) = transfer only.")
@click.option("--calibration-texts", type=int, default=None, help="Examples whose hidden states give the CKA.")
@click.option("--paper-maps", is_flag=True, default=False,
              help="The authors' unnormalised head maps instead of rankwise's least-squares ones.")
def transfer(run_dir: Path, new_base: str, out: Path, finetune_steps: int | None,
             calibration_texts: int | None, paper_maps: bool) -> None:
    """Move a LoRA run onto an upgraded base model (LoRASuite; docs/transfer.md)."""
    from rankwise.commands.transfer.run import TransferConfig, transfer_run
    given = {"finetune_steps": finetune_steps, "calibration_texts": calibration_texts,
             "normalise": False if paper_maps else None}
    record = transfer_run(run_dir, new_base, out, TransferConfig(**{k: v for k, v in given.items() if v is not None}))
    click.echo(f"{record['stage']}: layers {record['layer_mapping']}  W_x {record['w_x']['kind']}  "
               f"eval_loss {record['metrics'].get('eval_loss', float('nan')):.4g}")
    click.echo(f"wrote {out}")


def example(folder: Path) -> list[str]:
    """``folder/run`` onto the tiny Llama, into ``folder/out``."""
    return [str(folder / "run"), "--to", "tiny-llama", "--out", str(folder / "out")]


registry.register("command", "transfer", None, transfer, summary="move a LoRA run onto an upgraded base (LoRASuite)",
                  writes="train", example=example)
