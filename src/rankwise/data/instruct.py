"""A built-in prompt-completion source: ``data.source: stdlib-functions``.

Real text nobody on this project wrote: for the functions of a few standard-library packages,
the prompt is the function's docstring and the completion its ``def`` line (rebuilt from the
syntax tree: ``def name(args) -> annotation:``). Read with :mod:`ast` from the sources of the
running Python (nothing is imported), sorted by id, so the set is deterministic per version.
"""
from __future__ import annotations

import ast
from functools import lru_cache

from rankwise.data.demo import stdlib_dir
from rankwise.errors import RankwiseError

PACKAGES = ("json", "email", "http", "logging", "importlib", "xml", "asyncio", "unittest")
MAX_DOC_WORDS = 120


def def_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The ``def`` line of a function, rebuilt from its syntax tree (one line)."""
    head = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{head} {node.name}({ast.unparse(node.args)}){ret}:"


@lru_cache(maxsize=2)
def load_function_records(packages: tuple[str, ...] = PACKAGES) -> list[dict]:
    """Collect ``{"prompt", "completion", "id"}`` records (docstring -> ``def`` line).

    Args:
        packages: Standard-library packages (or single modules) to read.

    Returns:
        Records sorted by ``id`` (``module:function:line``); docstrings are whitespace-normalised
        and cut to their first ``MAX_DOC_WORDS`` words.

    Raises:
        RankwiseError: If none of the packages' sources are on this machine.
    """
    root = stdlib_dir()
    records = []
    for pkg in packages:
        paths = sorted((root / pkg).rglob("*.py")) if (root / pkg).is_dir() else [root / f"{pkg}.py"]
        for path in paths:
            rel = path.relative_to(root)
            if not path.is_file() or "test" in rel.parts[:-1] or path.name.startswith("test_"):
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
            except (SyntaxError, ValueError):
                continue
            module = ".".join(rel.with_suffix("").parts)
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                doc = ast.get_docstring(node)
                if not doc or len(doc.split()) < 3:
                    continue
                words = doc.split()[:MAX_DOC_WORDS]
                records.append({"prompt": " ".join(words) + "\n", "completion": def_line(node),
                                "id": f"{module}:{node.name}:{node.lineno}"})
    if not records:
        raise RankwiseError(f"no standard-library sources found under {root}; the "
                            "stdlib-functions source needs CPython's own .py files")
    records.sort(key=lambda r: r["id"])
    return records


__all__ = ["load_function_records", "def_line", "PACKAGES"]
