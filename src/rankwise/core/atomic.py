"""Atomic writes: a file or folder appears complete or not at all.

Temporary files and folders are created private (``mkstemp``/``mkdtemp`` use 0600/0700) and
given the permissions the user's umask asks for just before they are renamed into place, as
the files transformers writes: shared exports stay shareable.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def _publish_mode(path: str | os.PathLike, directory: bool = False) -> None:
    """Give a private temporary file/folder the mode a plain ``open``/``mkdir`` would have."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _publish_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, obj) -> None:
    """Atomically write ``obj`` as indented JSON."""
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


@contextlib.contextmanager
def folder(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder that replaces ``path`` only if the block succeeds.

    The previous contents of ``path`` survive any failure inside the block.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish_mode(tmp, directory=True)
    for sub in tmp.rglob("*"):  # files written by other libraries keep their own modes
        if sub.is_dir() and (sub.stat().st_mode & 0o777) == 0o700:
            _publish_mode(sub, directory=True)
        elif sub.is_file() and (sub.stat().st_mode & 0o777) == 0o600:
            _publish_mode(sub)
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_folder(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Check, before any work, that ``path`` can become a folder this process writes into.

    Args:
        path: The intended output folder (it may not exist yet).
        flag: The option that named it, for the message.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        RankwiseError: If ``path`` is an existing file, lies under a file, lies under a
            folder this user may not search, or its nearest existing folder is not writable
            (one line naming the fix).
    """
    from rankwise.errors import RankwiseError
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise RankwiseError(f"{flag} {path} is an existing file; choose a folder path")
        probe = path
        while not probe.exists():
            probe = probe.parent
    except PermissionError:  # a folder above it that this user may not look into
        raise RankwiseError(f"{flag} {path}: cannot look into a folder above it (permission "
                            "denied); choose a folder you can write to") from None
    if not probe.is_dir():
        raise RankwiseError(f"{flag} {path} lies under {probe}, which is a file; choose another path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise RankwiseError(f"{flag} {path}: cannot write into {probe} (permission denied); "
                            "choose a folder you can write to")
    return path


LOCK_FILE = ".rankwise.lock"


@contextlib.contextmanager
def locked_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Hold an exclusive lock on a run folder for the duration of the block.

    The lock is an ``flock`` on ``path/.rankwise.lock`` (holding the owner's pid): the
    operating system drops it when the process ends, however it ends, so a crashed run never
    leaves a stale lock behind. On the way out the file is removed, and so is the folder if this
    call created it and nothing else was written there (a run that failed on bad input leaves
    no trace).

    Args:
        path: The folder (created if missing).

    Yields:
        ``path`` as a ``Path``.

    Raises:
        RankwiseError: If another process holds the lock (one line naming its pid).
    """
    import fcntl

    from rankwise.errors import RankwiseError
    path = Path(path)
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
    held = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise RankwiseError(f"run folder {path} is in use by another rankwise process (pid "
                                f"{owner}); wait for it to finish or choose another --out") from None
        held = True
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        if held:  # remove while still holding it, then release by closing the descriptor
            (path / LOCK_FILE).unlink(missing_ok=True)
        os.close(fd)
        if held and created:
            with contextlib.suppress(OSError):
                path.rmdir()  # only if empty
