"""How many CPU threads torch computes with: the CPUs this process may actually use.

``os.cpu_count()`` counts the machine's cores. A process pinned to fewer (``taskset``, a Slurm
or Kubernetes cpuset) or throttled by a cgroup CPU quota (``docker --cpus 2``) has fewer, and
torch's default of one thread per core then oversubscribes them: its threads wait on each other
at every parallel region, and a small model ran 10-20x slower than on one thread (issue 18).

``train.threads: auto`` (the default) is :func:`auto_threads`: the CPUs of the process's
affinity mask, capped by the cgroup quota (rounded down: 1.5 CPUs of quota gives 1 thread),
divided among the processes that share them (``torchrun``'s ``LOCAL_WORLD_SIZE``; a parallel
``compare`` would pass its job count), and never more than torch was already told to use
(``OMP_NUM_THREADS``, an earlier ``torch.set_num_threads``). A load the kernel does not
account to this process (another program busy on a core) is not visible here: set
``train.threads: 1`` on a machine shared that way.
"""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Iterator, Union

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _quota(folder: Path) -> float | None:
    """CPUs allowed by the quota files in one cgroup folder (v2 ``cpu.max``, v1 CFS files)."""
    text = _read(folder / "cpu.max")
    if text:
        parts = text.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                return int(parts[0]) / int(parts[1])
            except (ValueError, ZeroDivisionError):
                return None
        return None
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpus(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup and its ancestors, in CPUs (the tightest one).

    Args:
        root: Where the cgroup file system is mounted.
        proc: ``/proc/self/cgroup`` (lines ``ID:CONTROLLERS:PATH``; ``0::PATH`` on cgroup v2).

    Returns:
        ``quota / period`` of the tightest limit, or ``None`` where there is none (or no cgroup
        file system, as on macOS).
    """
    folders: list[Path] = []
    for line in (_read(proc) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers and "cpu" not in controllers.split(","):
            continue
        # v2: one hierarchy at the root; v1: the cpu controller's own mount
        for base in [root] if not controllers else [root / controllers, root / "cpu"]:
            here = base / path.lstrip("/")
            folders.append(here)
            while here != base and base in here.parents:  # ancestors limit too; a container
                here = here.parent                         # sees its own cgroup at the root
                folders.append(here)
    limits = [q for q in (_quota(f) for f in dict.fromkeys(folders)) if q is not None]
    return min(limits) if limits else None


def available_cpus(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> int:
    """CPUs this process may run on: its affinity mask, capped by the cgroup quota (floor, >= 1).

    Args:
        root: The cgroup mount (tests point it at a folder of their own).
        proc: The process's cgroup list.
    """
    getaffinity = getattr(os, "sched_getaffinity", None)
    cpus = len(getaffinity(0)) if getaffinity is not None else (os.cpu_count() or 1)
    quota = cgroup_cpus(root, proc)
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)


def auto_threads(divisor: int = 1, root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> int:
    """``train.threads: auto``: :func:`available_cpus` shared by ``divisor`` processes (or
    parallel jobs), and no more than ``torch.get_num_threads()`` already is (``>= 1``)."""
    return max(1, min(torch.get_num_threads(), available_cpus(root, proc) // max(1, divisor)))


def local_processes() -> int:
    """Processes of this run on this machine (``torchrun`` sets ``LOCAL_WORLD_SIZE``; else 1)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def resolve_threads(setting: Union[int, str], divisor: int = 1) -> int:
    """The thread count of a ``train.threads`` value: an integer as given, ``auto`` from
    :func:`auto_threads`."""
    return auto_threads(divisor) if setting == "auto" else int(setting)


@contextlib.contextmanager
def use_threads(setting: Union[int, str], divisor: int = 1) -> Iterator[int]:
    """Compute with :func:`resolve_threads` torch threads inside the block; the previous count
    is restored after it (runs started in one process, as ``compare`` and tests do, each get
    their own setting)."""
    before = torch.get_num_threads()
    n = resolve_threads(setting, divisor)
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


__all__ = ["available_cpus", "auto_threads", "cgroup_cpus", "local_processes", "resolve_threads",
           "use_threads"]
