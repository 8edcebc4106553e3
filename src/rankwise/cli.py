"""The ``rankwise`` command: the group, its error handling, ``train``, and every command
registered as kind ``command`` (:mod:`rankwise.commands`; one from outside the package too).

Every mistake a user can make ends with one line on stderr and exit code 2; ``--debug``
shows the traceback instead. Subcommands import their heavy modules lazily.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from rankwise import registry
from rankwise.errors import RankwiseError

def _shared_by_rank_0() -> bool:
    """A torchrun rank > 0 whose error rank 0 prints as well (see ``errors_are_shared``)."""
    if os.environ.get("RANK", "0") in ("", "0"):
        return False
    from rankwise.engine.distributed import errors_are_shared
    return errors_are_shared()


class _Group(click.Group):
    """Turns user errors into one line + exit 2 (tracebacks only with --debug); its commands are
    ``train`` and the registry's kind ``command``, looked up when asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """``train`` and every registered command, sorted."""
        return sorted(set(super().list_commands(ctx)) | set(registry.names("command")))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        """The command called ``name``: ``train``, or the registered command's click command."""
        found = super().get_command(ctx, name)
        if found is None and name in registry.names("command"):
            found = registry.get("command", name).builder
        return found

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RankwiseError as err:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            if not _shared_by_rank_0():  # under torchrun: a config error once, not once per process
                click.echo(f"error: {err}", err=True)
            sys.exit(2)
        except KeyboardInterrupt as err:  # a command may say how to continue (compare does)
            click.echo(str(err) or "interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show full tracebacks.")
@click.version_option(package_name="rankwise")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """rankwise: low-rank and parameter-efficient training."""
    ctx.obj = {"debug": debug}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a config key (YAML value).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Run folder (default runs/<name>).")
@click.option("--resume", is_flag=True, help="Continue from the run folder's last checkpoint.")
def train(config: Path, sets: tuple[str, ...], out: Path | None, resume: bool) -> None:
    """Train an adapter (or all weights) as described by CONFIG.yaml.

    Under ``torchrun --nproc-per-node N -m rankwise train ...`` the N processes share the
    global ``train.batch_size``; only rank 0 writes the run folder.
    """
    from rankwise.engine.distributed import teardown
    from rankwise.recipes.config import load_run_config
    from rankwise.recipes.train import RunFinished
    from rankwise.recipes.train import train as run_train
    cfg = load_run_config(config, list(sets))
    out = out or Path("runs") / config.stem
    main_rank = os.environ.get("RANK", "0") in ("", "0")  # under torchrun only rank 0 reports
    try:
        metrics = run_train(cfg, out, resume=resume)  # under torchrun: one process each
    except RunFinished as done:
        if main_rank:
            click.echo(str(done), err=True)
        return
    finally:
        teardown()
    if main_rank:
        shown = [k for k in metrics if k.startswith("eval_")] + ["steps", "train_time_s"]
        click.echo("  ".join(f"{k} {metrics[k]:.4g}" if isinstance(metrics[k], float) else
                             f"{k} {metrics[k]}" for k in shown if k in metrics))
        click.echo(f"wrote {out}")



if __name__ == "__main__":  # pragma: no cover
    main()
