"""Read user data: CSV or JSONL files of records."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from rankwise.errors import RankwiseError


def read_records(path: str | Path) -> list[dict]:
    """Read a ``.csv`` (header row) or ``.jsonl`` (one object per line) file.

    Raises:
        RankwiseError: Missing, unreadable, malformed or empty file, or unknown extension.
    """
    path = Path(path)
    if not path.is_file():
        raise RankwiseError(f"data file {path} not found; set data.source to a .csv/.jsonl file or 'demo'")
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RankwiseError(f"cannot read data file {path}: {err}; save it as UTF-8 text") from None
    if suffix == ".csv":
        try:
            records = list(csv.DictReader(text.splitlines()))
        except csv.Error as err:
            raise RankwiseError(f"data file {path} is not valid CSV: {err}") from None
    elif suffix in (".jsonl", ".ndjson"):
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise RankwiseError(f"{path} line {n} is not valid JSON ({err.msg}); "
                                    "JSONL needs one JSON object per line") from None
            if not isinstance(obj, dict):
                raise RankwiseError(f"{path} line {n} is not a JSON object")
            records.append(obj)
    else:
        raise RankwiseError(f"data file {path} has extension {suffix!r}; expected .csv or .jsonl")
    if not records:
        raise RankwiseError(f"data file {path} holds no records; it needs at least one row")
    return records
