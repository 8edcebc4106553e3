"""A disk cache of the records the built-in sources read from the standard library.

``demo`` and ``stdlib-functions`` parse a few hundred standard-library files with :mod:`ast`
(about a CPU-second each) in every process that uses them: a ``rankwise train``, each torchrun
worker, each Flower ClientApp process. The records are kept as JSON under
``$XDG_CACHE_HOME/rankwise`` (``~/.cache/rankwise``), named by a hash of everything they depend
on: the interpreter's version, the standard library's folder, the size and modification time of
every file read, the packages asked for and the loader's own source file. Any change there
names another file, so a stale one is never read. Writing is atomic and best effort: an
unwritable cache folder only means parsing again.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

FORMAT = 1  # bump when the stored layout changes


def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/rankwise``, or ``~/.cache/rankwise``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rankwise"


def source_key(name: str, packages: tuple[str, ...], root: Path, files: Iterable[Path], loader: str) -> str:
    """The hash naming a cache entry (see the module docstring).

    Args:
        name: The source (``demo``, ``stdlib-functions``).
        packages: The packages its records come from.
        root: The standard library's folder.
        files: Every file the loader reads.
        loader: The path of the loader's source file.
    """
    h = hashlib.sha256(json.dumps([FORMAT, name, list(packages), sys.version, str(root)]).encode())
    h.update(Path(loader).read_bytes())
    for path in sorted(files):
        st = path.stat()
        h.update(f"{path.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def cached(key: str, name: str, build: Callable[[], Any]) -> Any:
    """The JSON value stored under ``key``, or ``build()``'s, stored for the next process.

    Args:
        key: :func:`source_key` of the records.
        name: The source, for the file name.
        build: Parses the records (JSON-serialisable: lists, dicts, strings, numbers).
    """
    path = cache_folder() / f"{name}-{key}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    value = build()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}-", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return value


__all__ = ["cache_folder", "cached", "source_key"]
