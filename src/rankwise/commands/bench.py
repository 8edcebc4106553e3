"""``rankwise bench NAME``: run a benchmark of the source checkout (``bench/rankwise_bench``; the
installed package holds none, so this only finds the checkout's folder and hands over by name)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click

from rankwise import registry
from rankwise.errors import RankwiseError


def _bench_folder() -> Path:
    """``bench/`` of the source checkout that holds the benchmarks (``bench/rankwise_bench``): the
    one beside this package's source tree, else the current directory's or a parent's.

    Raises:
        RankwiseError: When neither exists (an installed wheel has no benchmarks).
    """
    here = Path(__file__).resolve().parents[3]  # src/rankwise/commands/bench.py -> the checkout
    cwd = Path.cwd().resolve()
    for root in (here, cwd, *cwd.parents):
        if (root / "bench" / "rankwise_bench" / "__init__.py").is_file():
            return root / "bench"
    raise RankwiseError("rankwise bench runs the benchmarks of a source checkout (bench/rankwise_bench), "
                        "which the installed package does not hold: clone the rankwise repository and "
                        "run `rankwise bench NAME` from it")


@click.command(context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Run a benchmark of the checkout: NAME [--out DIR] [options] (no NAME: list them)."""
    folder = _bench_folder()
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    code = importlib.import_module("rankwise_bench").main(list(args))
    if code:
        sys.exit(code)


registry.register("command", "bench", None, bench, summary="run a benchmark of the source checkout")
