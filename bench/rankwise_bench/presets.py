"""The command line shared by the benchmarks that run from a preset of sizes:
``python -m rankwise_bench.<name> --out DIR [--preset P] [--set FIELD=VALUE ...]``."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any, Callable


def preset_main(argv: list[str] | None, *, module: str, doc: str, presets: dict[str, Any],
                default: str, run: Callable[..., dict],
                show: Callable[[dict], str] | None = None) -> dict:
    """Parse the preset command line, apply ``--set`` overrides to a copy of the preset's
    sizes dataclass and call ``run(out, sizes, command=...)``.

    Args:
        argv: The arguments (``None``: ``sys.argv[1:]``).
        module: The benchmark's module name (for the recorded command).
        doc: The benchmark's description (its module docstring).
        presets: ``{name: sizes dataclass instance}``.
        default: The preset used without ``--preset``.
        run: The benchmark's ``run(out, sizes, command=...)``.
        show: Renders the results to print afterwards (``None``: print nothing).

    Returns:
        The results dict; a user error prints one line and exits 2, as the rankwise command.
    """
    import yaml

    from rankwise.errors import RankwiseError
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", choices=sorted(presets), default=default)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a sizes field (YAML value), e.g. --set layers=4")
    args = parser.parse_args(argv)
    sizes = copy.deepcopy(presets[args.preset])
    names = {f.name for f in dataclasses.fields(sizes)}
    for item in args.sets:
        key, _, raw = item.partition("=")
        if key not in names:
            parser.error(f"--set {item!r}: unknown field; fields: {', '.join(sorted(names))}")
        value = yaml.safe_load(raw)
        setattr(sizes, key, tuple(value) if isinstance(value, list) else value)
    command = f"python -m {module} " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    try:
        res = run(args.out, sizes, command=command)
    except RankwiseError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if show is not None:
        print(show(res))
    return res
