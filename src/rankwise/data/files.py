"""Read user data through Hugging Face ``datasets``: Arrow tables, memory-mapped from disk.

A ``.jsonl`` / ``.csv`` / ``.parquet`` file is converted once into Arrow files in the
``datasets`` cache (``data.cache_dir``, else ``~/.cache/huggingface/datasets``); a folder written
by ``datasets.Dataset.save_to_disk`` is opened in place. Either way the records stay on disk
and are paged in on access, so a million-record file costs no Python object per record.
Field checks run on the Arrow columns (null counts, byte lengths), not on Python dicts.

Pages of a memory-mapped file that the process has touched stay in its resident set until the
file is unmapped, so one pass over a million records would leave the whole file resident.
:func:`release_pages` drops them (Linux ``madvise(MADV_DONTNEED)`` on the file's read-only
mappings; the kernel keeps them in its page cache, so a later read is a minor fault, not I/O).
"""
from __future__ import annotations

import csv
import ctypes
import json
import mmap
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from rankwise.errors import RankwiseError

SUFFIXES = {".jsonl": "json", ".ndjson": "json", ".csv": "csv", ".parquet": "parquet"}
WHAT = ".jsonl, .csv or .parquet file, a datasets save_to_disk folder, or 'demo'"
# Rows per record batch of a converted file. Opening a file maps every batch's header (and the
# kernel maps ~64 KiB around each), so 1,000-row batches (datasets' default) would leave ~64 bytes
# per record resident; 10,000 leave ~6.
WRITER_BATCH = 10_000


def quiet_datasets(progress: bool = False) -> None:
    """Silence ``datasets``' logging (and its progress bars unless ``progress``). Its error
    lines too: a file it cannot read becomes rankwise's own one-line error."""
    import datasets
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    if progress:
        datasets.enable_progress_bars()
    else:
        datasets.disable_progress_bars()


def json_lines(path: Path, where: str = "", errors: str = "strict") -> Iterator[tuple[int, Any]]:
    """The JSON value of every non-blank line of a JSONL file, read line by line.

    Args:
        path: The file.
        where: Prefix of the error message (``f"{path} "`` to name the file).
        errors: How undecodable UTF-8 bytes are handled (:func:`open`'s ``errors``).

    Yields:
        ``(line number, value)``, lines counted from 1.

    Raises:
        RankwiseError: ``"{where}line {n} is not valid JSON (...)"`` at the first line that is not.
    """
    with Path(path).open(encoding="utf-8", errors=errors) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as err:
                raise RankwiseError(f"{where}line {n} is not valid JSON ({err.msg})") from None


def _first_bad_json_line(path: Path) -> str:
    """Locate the first line of ``path`` that is not a JSON object (read line by line)."""
    try:
        for n, obj in json_lines(path, errors="replace"):
            if not isinstance(obj, dict):
                return f"line {n} is not a JSON object"
    except RankwiseError as err:
        return str(err)
    return "its records do not share one schema (a field changes type between lines)"


def _read_file(path: Path, builder: str, cache_dir: str | None):
    import datasets
    kwargs: dict[str, Any] = {}
    if builder == "csv":  # every cell is text, as the csv module reads it (no type guessing)
        with path.open(encoding="utf-8", errors="replace", newline="") as f:
            header = next(csv.reader(f), [])
        kwargs = {"features": datasets.Features({c: datasets.Value("string") for c in header})}
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir,
                                     writer_batch_size=WRITER_BATCH, **kwargs)
    except (datasets.exceptions.DatasetGenerationError, ValueError, TypeError) as err:
        cause = err.__cause__ or err
        if "corresponds to no data" in str(err):  # a CSV with only its header row
            raise RankwiseError(f"data file {path} holds no records; it needs at least one row") from None
        if builder == "json":
            raise RankwiseError(f"data file {path}: {_first_bad_json_line(path)}; JSONL needs one "
                                "JSON object per line") from None
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise RankwiseError(f"data file {path} is not valid {builder.upper()}: {first}") from None


def read_dataset(source: str | Path, cache_dir: str | None = None):
    """Open ``source`` as a ``datasets.Dataset`` (memory-mapped Arrow).

    Args:
        source: A ``.jsonl``/``.ndjson``, ``.csv`` (header row) or ``.parquet`` file, or a folder
            written by ``datasets.Dataset.save_to_disk``.
        cache_dir: Where ``datasets`` keeps its Arrow conversion (``None``: its default).

    Returns:
        The dataset (one row per record, in file order).

    Raises:
        RankwiseError: Missing, empty, malformed or unreadable source, an unknown extension,
            or a folder that holds several splits.
    """
    import datasets
    quiet_datasets()
    path = Path(source)
    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as err:
            raise RankwiseError(f"data folder {path} is not a datasets save_to_disk folder "
                                f"({str(err).splitlines()[0]}); set data.source to a {WHAT}") from None
        if isinstance(ds, datasets.DatasetDict):
            raise RankwiseError(f"data folder {path} holds several splits ({', '.join(ds)}); point "
                                f"data.source at one of them, e.g. {path / next(iter(ds))}")
    elif not path.is_file():
        raise RankwiseError(f"data file {path} not found; set data.source to a {WHAT} (relative paths are "
                            "read from the config file's folder, --set values from the current directory)")
    else:
        builder = SUFFIXES.get(path.suffix.lower())
        if builder is None:
            raise RankwiseError(f"data file {path} has extension {path.suffix!r}; expected a {WHAT}")
        if builder != "parquet":
            try:
                with path.open("rb") as f:
                    head = f.read(1 << 16).strip()
            except OSError as err:
                raise RankwiseError(f"cannot read data file {path}: {err.strerror}") from None
            if not head:
                raise RankwiseError(f"data file {path} holds no records; it needs at least one row")
            if builder == "json" and not head.startswith(b"{"):  # datasets would read a JSON array
                raise RankwiseError(f"data file {path}: {_first_bad_json_line(path)}; JSONL needs one "
                                    "JSON object per line")
        ds = _read_file(path, builder, cache_dir)
    if len(ds) == 0:
        raise RankwiseError(f"data {path} holds no records; it needs at least one row")
    release_pages(ds)  # opening read every record batch's header
    return ds


def _madvise():
    """libc's ``madvise`` through ctypes, or ``None`` where it (or ``MADV_DONTNEED``) is missing."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _madvise()


def release_pages(*sets: Any) -> int:
    """Drop the pages of these datasets' Arrow files from this process's resident memory.

    Only read-only mappings of the datasets' own cache files (``Dataset.cache_files``) are
    touched, so no data can change: a page read again is mapped again from the kernel's page
    cache. In-memory datasets and platforms without ``madvise`` are left as they are.

    Args:
        sets: ``datasets.Dataset`` objects (``None`` is skipped).

    Returns:
        Bytes of mappings advised (0 when there was nothing to release).
    """
    if _MADVISE is None:
        return 0
    files = {os.path.realpath(f["filename"]) for ds in sets if ds is not None
             for f in getattr(ds, "cache_files", None) or []}
    if not files:
        return 0
    released = 0
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            maps = f.read().splitlines()
    except OSError:
        return 0
    for line in maps:  # "start-end perms offset dev inode path"
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or parts[5] not in files or "w" in parts[1]:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if _MADVISE(start, end - start, mmap.MADV_DONTNEED) == 0:
            released += end - start
    return released


def check_fields(ds, source: str, fields: list[str], hint: str) -> None:
    """Check that every record of ``ds`` has each of ``fields`` (not null, not empty text).

    Runs on the Arrow columns: no record becomes a Python object, and text is judged empty by
    its byte length (the offsets), so the text itself is not read.

    Args:
        ds: A ``datasets.Dataset``.
        source: Its name, for messages.
        fields: Required columns.
        hint: The config keys that name these fields (``data.prompt_field``), for the fix.

    Raises:
        RankwiseError: Naming the first record (1-based) that lacks a field, or the missing
            column and the columns there are.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    have = list(ds.column_names)
    for field in fields:
        if field not in have:
            raise RankwiseError(f"{source}: no {field!r} field in any record (fields: {', '.join(have)}); "
                                f"set {hint} to the right column")
        col = ds.data.column(field)  # a ChunkedArray over the memory-mapped file
        bad = pc.is_null(col)
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            bad = pc.or_kleene(bad, pc.equal(pc.binary_length(col), 0))
        if pc.any(bad).as_py():
            first = pc.index(bad, True).as_py()
            what = "no" if col[first].as_py() is None else "an empty"
            raise RankwiseError(f"{source}: record {first + 1} has {what} {field!r} field; "
                                f"fill it in or remove the record (or set {hint} to the right column)")


__all__ = ["read_dataset", "check_fields", "quiet_datasets", "release_pages", "SUFFIXES"]
