"""The demo task: which standard-library package does a docstring come from?

Real text nobody on this project wrote: the docstrings of functions and classes in eight
packages of the running Python's standard library, read with :mod:`ast` from the source files
(nothing is imported or executed). The packages exist in CPython 3.10-3.13; the exact set of
docstrings varies a little by version, so results should be reported with the Python version.
"""
from __future__ import annotations

import ast
import hashlib
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path

from rankwise.data.stdlib_cache import cached, source_key
from rankwise.errors import RankwiseError

PACKAGES = ("asyncio", "email", "http", "importlib", "logging", "multiprocessing", "tkinter", "xml")
MIN_WORDS = 5


def stdlib_dir() -> Path:
    """Return the folder holding the standard library's ``.py`` sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def _docstrings(path: Path, module: str) -> list[tuple[str, str]]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc.split()) >= MIN_WORDS:
                out.append((f"{module}:{node.name}:{node.lineno}", " ".join(doc.split())))
    return out


@lru_cache(maxsize=2)
def load_demo_records(packages: tuple[str, ...] = PACKAGES) -> tuple[list[dict], list[str]]:
    """Collect the demo records.

    Args:
        packages: Standard-library packages; each is one class.

    Returns:
        ``(records, label_names)``; each record is ``{"text", "label", "id", "package"}``,
        sorted by ``id`` so the order is deterministic.

    Raises:
        RankwiseError: If a package's sources are not on this machine.
    """
    root = stdlib_dir()
    files: list[tuple[int, str, Path]] = []  # (label, package, file)
    for label, pkg in enumerate(packages):
        folder = root / pkg
        if not folder.is_dir():
            raise RankwiseError(f"standard-library package {pkg!r} not found under {root}; "
                                "the demo needs CPython's own sources (3.10-3.13)")
        files += [(label, pkg, path) for path in sorted(folder.rglob("*.py"))
                  if "test" not in path.relative_to(folder).parts[:-1] and not path.name.startswith("test_")]

    def parse() -> list[dict]:
        records = []
        for label, pkg, path in files:
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            for ident, text in _docstrings(path, module):
                records.append({"text": text, "label": label, "id": ident, "package": pkg})
        records.sort(key=lambda r: r["id"])
        return records
    key = source_key("demo", packages, root, [f for _, _, f in files], __file__)
    return cached(key, "demo", parse), list(packages)


def split_of(ident: str, eval_fraction: float) -> str:
    """Deterministic split by a hash of the record id: ``"eval"`` or ``"train"``."""
    h = int(hashlib.sha256(ident.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "eval" if h < eval_fraction else "train"


def python_version() -> str:
    """Return ``"3.11.7"``-style version of the interpreter that built the data."""
    return ".".join(map(str, sys.version_info[:3]))
