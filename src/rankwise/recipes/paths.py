"""Relative paths in a config file are read from the file's own folder.

The rule (docs: README, "Paths in a config file"): in a YAML config, a relative value of a key
that names a local file or folder (:data:`RUN_PATHS`, :data:`DISTILL_PATHS`) is read from the
folder holding that YAML file, so ``examples/plan-llama3-8b-qlora.yaml`` finds its
``llama-3-8b`` beside it from any working directory. What is not a path stays as written:

* the key's built-in names (``model.path: demo``, ``tiny-llama``; ``data.source: demo``,
  ``stdlib-functions``; ``stdlib``, ``stdlib-heldout`` and ``data`` of a text section;
  ``data.select.target: demo:PKG``), and a ``data.chat_template`` that is Jinja text;
* absolute paths and ``~/...``.

A relative value found in the current directory but not in the config's folder is still read
from the current directory (configs written before this rule); one found in neither place is
taken to mean the config's folder, so the error names the path it looked for. ``--set``
values are read from the current directory, as command-line paths are. Run folders store
every path absolute in their ``config.yaml`` (:func:`rankwise.recipes.config._absolute_paths`),
so they never depend on either.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rankwise.compress.config import RUN_DATA, STDLIB, STDLIB_HELDOUT
from rankwise.data.text import BUILTIN
from rankwise.recipes.model import TINY

# dotted key -> names that key takes which are not paths (prefixes end with ":")
MODEL_NAMES = ("demo", *TINY)
TEXT_NAMES = (STDLIB, STDLIB_HELDOUT, RUN_DATA)  # a text section's sources (compress, distill)
RUN_PATHS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("model", "path"): MODEL_NAMES,
    ("data", "source"): BUILTIN,
    ("data", "eval_source"): BUILTIN,
    ("data", "chat_template"): (),
    ("data", "select", "target"): ("demo:",),
    ("data", "select", "from"): (),
    ("memory_decoder", "base"): (),  # the old spelling; task.<key>: its config class's paths
    ("compress", "calibration", "source"): TEXT_NAMES,
    ("compress", "heldout", "source"): TEXT_NAMES,
}
DISTILL_PATHS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("data", "source"): TEXT_NAMES, ("heldout", "source"): TEXT_NAMES}


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        return False


def _is_path(key: tuple[str, ...], value: Any, names: tuple[str, ...]) -> bool:
    """Whether ``value`` of ``key`` names a relative local path (not a built-in name)."""
    if not isinstance(value, str) or not value.strip() or value in names:
        return False
    if any(n.endswith(":") and value.startswith(n) for n in names):
        return False
    if key[-1] == "chat_template" and ("{%" in value or "{{" in value):
        return False  # Jinja text, not a file
    return not Path(value).expanduser().is_absolute()


def resolve_relative(data: dict, folder: Path, keys: dict[tuple[str, ...], tuple[str, ...]] = RUN_PATHS
                     ) -> dict:
    """Read the relative path values of ``data`` (a raw config) from ``folder`` (module docstring).

    Args:
        data: The raw mapping read from a config file; changed in place.
        folder: The folder holding the config file.
        keys: Which dotted keys hold paths, with their built-in names.

    Returns:
        ``data``, its relative path values replaced by absolute paths into ``folder`` (a value
        whose file is the same from the current directory is left as written).
    """
    folder, cwd = Path(folder).resolve(), Path.cwd().resolve()
    for key, names in keys.items():
        node: Any = data
        for part in key[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        value = node.get(key[-1])
        if not _is_path(key, value, names):
            continue
        here, there = folder / value, cwd / value
        if _exists(here) or not _exists(there):
            if here.resolve() != there.resolve():  # the same file either way: left as written
                node[key[-1]] = str(here.resolve())
    return data


__all__ = ["DISTILL_PATHS", "RUN_PATHS", "resolve_relative"]
