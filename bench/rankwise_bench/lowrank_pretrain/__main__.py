"""``rankwise bench lowrank-pretrain``'s command line: the benchmark at a named size, with rows
and size fields chosen on the command line (``bench/gpu/lowrank-pretrain.sh`` runs the 1b size).

Example::

    rankwise bench lowrank-pretrain --size 1b --rows adamw,galore,galore-oja \\
        --set steps=500 --out bench/results/lowrank-pretrain-1b
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

import yaml

from rankwise_bench.lowrank_pretrain import METHODS, ROWS, SIZES, run, sizes
from rankwise_bench.lowrank_pretrain.rows import Sizes
from rankwise.errors import RankwiseError, closest


def _coerce(key: str, value, item: str):
    """``value`` as the type of ``Sizes.key`` (YAML reads ``1e-3`` as a string)."""
    default = getattr(Sizes(), key)
    try:
        if isinstance(default, tuple):
            return tuple(float(v) for v in (value if isinstance(value, list) else [value]))
        return type(default)(value)
    except (TypeError, ValueError):
        raise RankwiseError(f"--set {item!r}: expected a {type(default).__name__}") from None


def parse(argv: list[str]) -> tuple:
    """``(out, Sizes, rows)`` from the command line.

    Raises:
        RankwiseError: On an unknown size field or row, or a value that is not valid YAML.
    """
    ap = argparse.ArgumentParser(prog="rankwise bench lowrank-pretrain")
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--rows", default=",".join(METHODS), help=f"comma-separated rows of {list(ROWS)}")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a Sizes field (YAML value), e.g. steps=500 or lrs=[1e-3]")
    args = ap.parse_args(argv)
    valid = {f.name for f in fields(Sizes)}
    over = {}
    for item in args.sets:
        key, sep, raw = item.partition("=")
        if not sep or key not in valid:
            raise RankwiseError(f"--set {item!r}: expected FIELD=VALUE with a field of {sorted(valid)}"
                                f"{closest(key, valid)}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise RankwiseError(f"--set {item!r}: the value is not valid YAML") from None
        over[key] = _coerce(key, value, item)
    rows = tuple(r.strip() for r in args.rows.split(",") if r.strip())
    return args.out, sizes(args.size, **over), rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; user errors end with one line and exit code 2."""
    try:
        out, s, rows = parse(sys.argv[1:] if argv is None else argv)
        run(out, s, rows)
    except RankwiseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}/results.json and {out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
