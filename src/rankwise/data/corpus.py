"""A built-in pretraining corpus: ``data.source: stdlib-source``.

Real text nobody on this project wrote: every ``.py`` file of the running Python's standard
library (source code, comments and docstrings), one record per module, read as text (nothing is
imported). Test suites, ``idlelib`` and ``site-packages`` are left out. The text is the Python
Software Foundation's, under the PSF License Agreement (``LICENSE.txt`` of the Python
installation), which permits derivative works such as a model trained on it.

Whole modules are held out, never parts of one: a module is in the evaluation split when
``crc32(module name) % 10 == 0`` (about a tenth of the bytes; the same split as the corpus of the
``lowrank-pretrain`` benchmark), so a model evaluated on it has seen no line of those files. The
record's ``heldout`` column carries that decision and overrides ``data.eval_fraction``.
"""
from __future__ import annotations

import zlib
from functools import lru_cache

from rankwise.data.demo import stdlib_dir
from rankwise.errors import RankwiseError

SKIP = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})


def heldout_module(module: str) -> bool:
    """Whether a standard-library module belongs to the held-out split (``crc32 % 10 == 0``)."""
    return zlib.crc32(module.encode()) % 10 == 0


@lru_cache(maxsize=1)
def load_source_records() -> list[dict]:
    """The standard library's non-empty modules as ``{"text", "id", "heldout"}`` records, by id.

    Returns:
        One record per ``.py`` file: its text (UTF-8, undecodable bytes replaced), the dotted
        module name as ``id`` and whether the module is held out (:func:`heldout_module`).

    Raises:
        RankwiseError: If the standard library's sources are not on this machine.
    """
    root = stdlib_dir()
    records = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP & set(rel.parts) or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():  # an empty __init__.py has nothing to learn from
            continue
        module = ".".join(rel.with_suffix("").parts)
        records.append({"text": text, "id": module, "heldout": heldout_module(module)})
    if not records:
        raise RankwiseError(f"no standard-library sources found under {root}; the stdlib-source "
                            "data needs CPython's own .py files")
    return records


__all__ = ["heldout_module", "load_source_records", "SKIP"]
