"""A built-in prompt-completion source: ``data.source: stdlib-functions``.

Real text nobody on this project wrote: for the functions of a few standard-library packages,
the prompt is the function's docstring and the completion its ``def`` line (rebuilt from the
syntax tree: ``def name(args) -> annotation:``). Read with :mod:`ast` from the sources of the
running Python (nothing is imported), sorted by id, so the set is deterministic per version.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache

from rankwise.data.demo import stdlib_dir
from rankwise.data.stdlib_cache import cached, source_key
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
    files = []
    for pkg in packages:
        paths = sorted((root / pkg).rglob("*.py")) if (root / pkg).is_dir() else [root / f"{pkg}.py"]
        files += [path for path in paths if path.is_file() and "test" not in path.relative_to(root).parts[:-1]
                  and not path.name.startswith("test_")]

    def parse() -> list[dict]:
        records = []
        for path in files:
            try:
                tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
            except (SyntaxError, ValueError):
                continue
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                doc = ast.get_docstring(node)
                if not doc or len(doc.split()) < 3:
                    continue
                words = doc.split()[:MAX_DOC_WORDS]
                records.append({"prompt": " ".join(words) + "\n", "completion": def_line(node),
                                "id": f"{module}:{node.name}:{node.lineno}"})
        records.sort(key=lambda r: r["id"])
        return records
    records = cached(source_key("stdlib-functions", packages, root, files, __file__), "stdlib-functions", parse) \
        if files else []
    if not records:
        raise RankwiseError(f"no standard-library sources found under {root}; the "
                            "stdlib-functions source needs CPython's own .py files")
    return records


def _canonical(text: str) -> str | None:
    """One ``def`` line from ``text`` with the spacing a word-piece tokenizer's decoding adds
    undone (``_ get _ name`` -> ``_get_name``, ``- >`` -> ``->``, ``* *`` -> ``**``);
    ``None`` when it does not start with ``def`` / ``async def``."""
    lines = text.strip().splitlines()
    m = re.match(r"(async\s+)?def\s+(.*)", " ".join(lines[0].split()) if lines else "")
    if m is None:
        return None
    rest = re.sub(r"\s*_\s*", "_", m.group(2))
    rest = re.sub(r"\*\s*\*", "**", re.sub(r"-\s*>", "->", rest))
    return ("async def " if m.group(1) else "def ") + rest


def parsed_name(completion: str) -> str | None:
    """The function name of ``completion`` if its first line parses as a ``def`` line, else
    ``None`` (spacing-tolerant, see :func:`_canonical`)."""
    line = _canonical(completion)
    if line is None:
        return None
    try:
        tree = ast.parse(line + "\n    pass\n")
    except (SyntaxError, ValueError):
        return None
    node = tree.body[0] if len(tree.body) == 1 else None
    return node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def def_line_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """The task reward of ``stdlib-functions``: 1.0 where the completion parses as a ``def`` line
    naming the record's function, else 0.0 (a ``module:function`` reward callable).

    Names compare case-insensitively, and the spacing a word-piece tokenizer's decoding puts
    around ``_``, ``->`` and ``**`` is undone first (the packaged tiny models use the uncased
    MiniLM tokenizer, whose decoding writes ``def _ get _ name ( self ) :``).

    Args:
        prompts: The prompts (docstrings; unused).
        completions: The generated completions.
        **columns: The records' other fields, one list each: ``id`` (``module:function:line``,
            as :func:`load_function_records` writes it), or ``completion`` (the reference
            ``def`` line), or ``name``.

    Returns:
        One reward per completion.

    Raises:
        ValueError: If no column names the expected function.
    """
    if "name" in columns:
        names = list(columns["name"])
    elif "id" in columns:
        names = [str(i).split(":")[-2] for i in columns["id"]]
    elif "completion" in columns:
        names = [parsed_name(str(c)) for c in columns["completion"]]
    else:
        raise ValueError("def_line_reward needs the expected function: pass the records' id, "
                         "completion or name column")
    out = []
    for text, name in zip(completions, names):
        got = parsed_name(text)
        out.append(float(got is not None and name is not None and got.lower() == name.lower()))
    return out


__all__ = ["load_function_records", "def_line", "PACKAGES", "def_line_reward", "parsed_name"]
