"""What an output folder holds, recorded by the command that wrote it.

Every command that writes a folder of its own (``train``, ``federated``, ``compress``,
``compare``, ``demo``) puts ``rankwise.json`` there, ``{"kind": ...}``; ``compress`` also lists
the files it wrote, so ``--overwrite`` replaces exactly those. A command refuses a folder that
holds another kind of output (one line naming what is there and what to do), so no command can
mix its files into, or delete, another command's output. Folders written before the record
existed are recognised by their files (:func:`kind`).

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
    "model": "a transformers model folder (a base model or a merged export)",
    "peft": "a PEFT adapter (an export)",
    "adapter": "a rankwise adapter (an export)",
    "other": "files that no rankwise command wrote there",
}


def record(folder: str | Path, kind: str, **extra) -> None:
    """Write ``folder/rankwise.json`` saying the folder holds ``kind`` (plus ``extra`` keys)."""
    assert kind in WHAT, kind
    atomic.write_json(Path(folder) / RECORD, {"kind": kind, **extra})


def read_record(folder: str | Path) -> dict | None:
    """The folder's ``rankwise.json``, or None (absent or unreadable)."""
    try:
        data = json.loads((Path(folder) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("kind") in WHAT else None


def entries(folder: str | Path) -> list[str]:
    """Names in ``folder`` other than the neutral ones (empty if it does not exist)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name not in NEUTRAL)


def kind(folder: str | Path) -> str | None:
    """What ``folder`` holds: ``None`` when it is missing or empty, else one of :data:`WHAT`.

    The record decides; without one (folders written by older versions) the files do:
    ``rounds.jsonl`` or a ``config.yaml`` with a ``federated`` section and no training files
    is a federated run, ``config.yaml`` a train run, ``compression.safetensors`` with
    ``report.json`` a compress output, ``summary.json`` the demo, row folders marked by compare
    (``ROW/seedN/compare_plan.json``) a comparison, ``adapter_config.json`` a PEFT adapter,
    ``config.json`` a transformers model, ``rankwise_adapter.json`` a rankwise adapter.
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
        return "train"
    if {"compression.safetensors", "report.json"} <= names:
        return "compress"
    if "summary.json" in names and "learning_curve.png" in names:
        return "demo"
    if any(folder.glob(f"*/*/{COMPARE_PLAN}")):
        return "compare"
    if "adapter_config.json" in names:
        return "peft"
    if "config.json" in names:
        return "model"
    if "rankwise_adapter.json" in names:
        return "adapter"
    return "other"


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
        raise RankwiseError(f"{flag} {folder} holds {WHAT[found]}, not {WHAT[wanted]}; {fix}")
    return found


def check_run(run_dir: str | Path, command: str) -> None:
    """Raise unless ``run_dir`` holds a train run (what ``export`` and ``generate`` read).

    Raises:
        RankwiseError: Naming what the folder holds instead (a federated run saves no adapter).
    """
    found = kind(run_dir)
    if found not in ("train", None):
        raise RankwiseError(f"{run_dir} holds {WHAT[found]}, not {WHAT['train']}; {command} reads "
                            "the --out folder of a finished 'rankwise train'")


__all__ = ["RECORD", "WHAT", "check_kind", "check_run", "entries", "kind", "read_record", "record"]
