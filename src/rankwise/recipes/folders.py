"""What an output folder holds, recorded by the command that wrote it.

Every command that writes a folder of its own (``train``, ``federated``, ``compress``,
``compare``, ``demo``, ``select``, ``inspect``, ``merge``, ``distill``, ``vfl``) puts
``rankwise.json`` there, ``{"kind": ...}``; ``compress`` also lists the files it wrote, so
``--overwrite`` replaces exactly those. A command refuses a folder that holds another kind of
output, or files no rankwise command wrote (one line naming what is there and what to do), so
no command can mix its files into, overwrite, or delete another command's output or the user's
own files. Folders written before the record existed are recognised by their files
(:func:`kind`).

Exports (``rankwise export``) carry no record: they are read by PEFT and transformers, and
every command already refuses a non-empty folder that is not its own.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from rankwise.core import atomic
from rankwise.errors import RankwiseError

RECORD = "rankwise.json"
COMPARE_PLAN = "compare_plan.json"  # compare's mark on each of its train runs (recipes.compare)
# files that say nothing about a folder's kind: the run lock, and compare's mark beside a train run
NEUTRAL = {atomic.LOCK_FILE, COMPARE_PLAN}

WHAT = {
    "train": "a train run (rankwise train)",
    "federated": "a federated run (rankwise federated)",
    "compress": "a compress output (rankwise compress)",
    "compare": "a comparison (rankwise compare)",
    "demo": "the demo's output (rankwise demo)",
    "select": "a data selection (rankwise select)",
    "inspect": "an inspect report (rankwise inspect)",
    "merge": "a merged adapter (rankwise merge)",
    "distill": "a distill run (rankwise distill)",
    "vfl": "a vfl run (rankwise vfl)",
    "model": "a transformers model folder (a base model or a merged export)",
    "peft": "a PEFT adapter (an export)",
    "adapter": "a rankwise adapter (an export)",
    "other": "files that no rankwise command wrote there",
}


def what(kind: str) -> str | None:
    """How messages name a folder of ``kind``: its :data:`WHAT` line, or for the kind a command
    registered from outside the package writes (``Entry.writes``), its summary; ``None`` when
    no command writes ``kind``."""
    if kind in WHAT:
        return WHAT[kind]
    from rankwise import registry
    for name in registry.names("command"):
        entry = registry.get("command", name)
        if entry.writes == kind:
            return f"{entry.summary} (rankwise {name})"
    return None


def record(folder: str | Path, kind: str, **extra) -> None:
    """Write ``folder/rankwise.json`` saying the folder holds ``kind`` (plus ``extra`` keys)."""
    assert what(kind) is not None, kind
    atomic.write_json(Path(folder) / RECORD, {"kind": kind, **extra})


def read_record(folder: str | Path) -> dict | None:
    """The folder's ``rankwise.json``, or None (absent or unreadable)."""
    try:
        data = json.loads((Path(folder) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
        return None
    return data if what(data["kind"]) is not None else None


def entries(folder: str | Path) -> list[str]:
    """Names in ``folder`` other than the neutral ones (empty if it does not exist)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name not in NEUTRAL)


def kind(folder: str | Path) -> str | None:
    """What ``folder`` holds: ``None`` when it is missing or empty, else one of :data:`WHAT` (or
    the recorded kind of a command registered from outside the package, :func:`what`).

    The record decides; without one (folders written by older versions) the files do:
    ``rounds.jsonl`` or a ``config.yaml`` with a ``federated`` section and no training files
    is a federated run, a ``config.yaml`` whose only section is ``vfl`` a vfl run,
    ``config.yaml`` a train run, ``distill.yaml`` a distill run, ``compression.safetensors``
    with ``report.json`` a compress output, ``inspect.json`` with ``report.md`` an inspect
    report, ``summary.json`` the demo, row folders marked by compare
    (``ROW/seedN/compare_plan.json``) a comparison, ``merge.json`` beside
    ``adapter_config.json`` a merged adapter, ``adapter_config.json`` a PEFT adapter,
    ``config.json`` a transformers model, ``rankwise_adapter.json`` a rankwise adapter, and
    exactly ``scores.jsonl``, ``chosen.json`` (with select's keys) and ``scores.png`` a data
    selection. Anything else is ``other``: files of the user's own, which no command writes into.
    """
    names = set(entries(folder))
    if not names:
        return None
    saved = read_record(folder)
    if saved is not None:
        return saved["kind"]
    folder = Path(folder)
    if "rounds.jsonl" in names:
        return "federated"
    if "config.yaml" in names:
        if not names & {"checkpoints", "adapter", "model", "events.jsonl"}:
            try:
                cfg = yaml.safe_load((folder / "config.yaml").read_text())
            except (OSError, yaml.YAMLError):
                cfg = None
            if isinstance(cfg, dict) and cfg.get("federated"):
                return "federated"
            if isinstance(cfg, dict) and set(cfg) == {"vfl"}:
                return "vfl"
        return "train"
    if "distill.yaml" in names:
        return "distill"
    if {"compression.safetensors", "report.json"} <= names:
        return "compress"
    if {"inspect.json", "report.md"} <= names:
        return "inspect"
    if "summary.json" in names and "learning_curve.png" in names:
        return "demo"
    if any(folder.glob(f"*/*/{COMPARE_PLAN}")):
        return "compare"
    if {"merge.json", "adapter_config.json"} <= names:
        return "merge"
    if "adapter_config.json" in names:
        return "peft"
    if "config.json" in names:
        return "model"
    if "rankwise_adapter.json" in names:
        return "adapter"
    if names == SELECT_FILES and _is_selection(folder / "chosen.json"):
        return "select"
    return "other"


SELECT_FILES = {"scores.jsonl", "chosen.json", "scores.png"}  # what rankwise select writes


def _is_selection(path: Path) -> bool:
    """Whether ``path`` is a ``chosen.json`` written by ``rankwise select`` (method and ids)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"method", "ids", "seconds"} <= set(data)


def check_kind(folder: str | Path, wanted: str, fix: str, flag: str = "--out") -> str | None:
    """Raise unless ``folder`` is missing, empty, or holds ``wanted``; return its kind.

    Args:
        folder: The folder a command is about to write into or read.
        wanted: The kind the command writes (or reads).
        fix: What the user should do instead (the end of the one-line message).
        flag: How the folder was named on the command line.

    Raises:
        RankwiseError: ``"{flag} {folder} holds <what>, not <wanted>; {fix}"``.
    """
    found = kind(folder)
    if found not in (None, wanted):
        raise RankwiseError(f"{flag} {folder} holds {what(found)}, not {what(wanted)}; {fix}")
    return found


def check_writable(folder: str | Path, wanted: str, command: str) -> str | None:
    """:func:`check_kind` for a command that may write into its own earlier output only.

    Returns:
        ``None`` for a missing or empty folder, else ``wanted``.

    Raises:
        RankwiseError: ``"--out DIR holds <what>, not <wanted>; <command> writes only into a new
            or empty folder or its own earlier output: choose another --out"``.
    """
    return check_kind(folder, wanted, f"{command} writes only into a new or empty folder or its "
                      "own earlier output: choose another --out")


def check_run(run_dir: str | Path, command: str) -> None:
    """Raise unless ``run_dir`` holds a train run (what ``export`` and ``generate`` read).

    Raises:
        RankwiseError: Naming what the folder holds instead (a federated run saves no adapter).
    """
    found = kind(run_dir)
    if found not in ("train", None):
        raise RankwiseError(f"{run_dir} holds {what(found)}, not {WHAT['train']}; {command} reads "
                            "the --out folder of a finished 'rankwise train'")


__all__ = ["RECORD", "WHAT", "check_kind", "check_run", "check_writable", "entries", "kind", "read_record", "record", "what"]
