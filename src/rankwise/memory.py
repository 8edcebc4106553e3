"""The one memory meter: runs, benchmarks and ``compare`` all measure peak memory here.

Definition (``memory_meter`` in ``metrics.json`` and benchmark results names which applies):

* ``cuda_max_allocated``: on a CUDA device, ``torch.cuda.max_memory_allocated`` during the
  block minus ``torch.cuda.memory_allocated`` at its start - the peak bytes of live tensors
  the block added (the caching allocator's reserved-but-free blocks do not count).
* ``cpu_live_tensors``: on CPU, the same quantity from the torch profiler's allocation
  events: every CPU tensor allocation and free, summed in time order, and the running
  maximum above the level at the start. Process RSS is *not* used: it only grows within one
  process and includes allocator caches and the Python heap, so it cannot compare two
  models in one process, and it samples (missing short peaks).

The profiler costs a few percent of step time at real sizes (more on toy models). Long blocks
call :meth:`PeakMemory.flush` between steps so the profiler never holds more than one step's
events.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

import torch
from torch import nn

METERS = {
    "cuda_max_allocated": "torch.cuda.max_memory_allocated during the block minus the bytes "
                          "allocated at its start",
    "cpu_live_tensors": "peak bytes of live CPU tensors during the block above the level at its "
                        "start (torch profiler allocation events, summed in time order)",
}


def meter_name(device: str | torch.device) -> str:
    """The meter used on ``device``: ``cuda_max_allocated`` or ``cpu_live_tensors``."""
    return "cuda_max_allocated" if str(device).startswith("cuda") else "cpu_live_tensors"


def rss_mb() -> float:
    """Current resident set size of this process in MiB (Linux ``/proc``; 0 elsewhere).

    Not the memory meter (see the module docstring); kept for diagnostics.
    """
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return 0.0


def tensor_bytes(*objects: nn.Module | dict | torch.Tensor) -> int:
    """Bytes of the distinct storages held by modules (parameters and buffers), optimizer
    state dicts or tensors; a storage shared by several tensors counts once.

    Args:
        objects: Modules, ``optimizer.state`` mappings (nested dicts of tensors) or tensors.

    Returns:
        The total in bytes (packed quantized weights count at their packed size).
    """
    seen: dict[tuple, int] = {}

    def add(t: torch.Tensor) -> None:
        s = t.untyped_storage()
        seen[(t.device.type, s.data_ptr())] = s.nbytes()

    def walk(obj) -> None:
        if isinstance(obj, torch.Tensor):
            add(obj)
        elif isinstance(obj, nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                add(t)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    for o in objects:
        walk(o)
    return sum(seen.values())


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (kineto prints a line at every profiler start and stop)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# CPU meters currently measuring, outermost first; they share one profiler (kineto runs one).
_ACTIVE: list["PeakMemory"] = []
_PROFILER: list = []
_ACTIVE_CUDA: list["PeakMemory"] = []  # CUDA meters, which share the device's peak counter


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Hold Ctrl-C back while the profiler starts or stops: a KeyboardInterrupt raised inside
    kineto's start or stop leaves it half-registered, and the process then dies with SIGSEGV at
    exit instead of exiting 130 with its checkpoint (10 runs in 95 did, before this). A SIGINT
    that arrives meanwhile is only noted, and raised again under the old handler when the block
    ends (masking the signal is not enough: one already received is raised at the next bytecode)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is None:  # a handler set outside Python: leave it be
        yield
        return
    held: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if held:
            signal.raise_signal(signal.SIGINT)


_UNKNOWN_FREE_SEEN: list[bool] = []  # the allocator's first "unknown size" free happened


def _spend_unknown_free_warning() -> None:
    """c10's CPU allocator logs "Memory block of unknown size was allocated before the profiling
    started" at the 1st (then every 1000th) free of a block allocated before profiling: once in
    every run, and in every torchrun process. Make a block of our own that 1st free, under a
    throwaway profiler with stderr quiet (its events reach no meter); once per process."""
    if _UNKNOWN_FREE_SEEN:
        return
    from torch.profiler import ProfilerActivity, profile
    canary = torch.empty(1)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.__enter__()
        del canary
        prof.__exit__(None, None, None)
    prof.profiler = None  # its results would wait for the cyclic collector (see _fold)
    _UNKNOWN_FREE_SEEN.append(True)


def _start_profiler() -> None:
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _ctrl_c_deferred():
        _spend_unknown_free_warning()
        with _quiet_stderr():
            prof.__enter__()
            _PROFILER.append(prof)


def _fold(restart: bool) -> None:
    """Stop the shared profiler, feed its allocation events to every active CPU meter, and
    start it again if ``restart`` (a Ctrl-C meanwhile is raised after all of it)."""
    with _ctrl_c_deferred():
        if _PROFILER:  # empty only if an interrupt left the profiler stopped
            prof = _PROFILER.pop()
            with _quiet_stderr():
                prof.__exit__(None, None, None)
            events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"
                            and e.device_type() == torch.autograd.DeviceType.CPU)
            # the profiler's objects form a reference cycle that only the cyclic collector frees,
            # and its results are C++ memory Python does not count, so the collector rarely runs:
            # without the cut every step's events stayed resident (~150 MiB a step on a 6M model)
            prof.profiler.kineto_results = None
            prof.profiler = None
            for meter in _ACTIVE:
                meter._add([n for _, n in events])
        if restart:
            _start_profiler()


class PeakMemory:
    """Context manager: the peak memory a block of work adds, by the meter of ``device``.

    Meters nest (a GoRA calibration measured inside a benchmark's block): each reports the
    peak above its own start. A meter made with ``apart=True`` is kept out of the enclosing
    meters' peaks (they see only the block's net change in live bytes): a run's evaluations,
    measured apart from its training steps.

    Args:
        device: ``cpu`` or ``cuda[:n]``.
        apart: Keep this block's transient memory out of the enclosing meters' peaks.

    Attributes:
        meter: :func:`meter_name` of the device.
        peak_bytes: The measured peak above the start level, after the block (or a flush).
        peak_mb: The same in MiB.
    """

    def __init__(self, device: str | torch.device = "cpu", apart: bool = False) -> None:
        self.device = str(device)
        self.meter = meter_name(self.device)
        self.apart = apart
        self.peak_bytes = 0
        self._live = 0
        self._outer: list[PeakMemory] = []

    @property
    def peak_mb(self) -> float:
        """The peak in MiB."""
        return self.peak_bytes / 2**20

    def _add(self, sizes: list[int]) -> None:
        for n in sizes:
            self._live += n
            self.peak_bytes = max(self.peak_bytes, self._live)

    def flush(self) -> None:
        """Fold the events recorded so far and keep measuring (call between steps of long
        blocks; a no-op on CUDA)."""
        if self in _ACTIVE:
            _fold(restart=True)

    def __enter__(self) -> "PeakMemory":
        if self.meter == "cuda_max_allocated":
            torch.cuda.synchronize(self.device)
            for outer in _ACTIVE_CUDA:  # the reset below must not lose an enclosing block's peak
                outer._seen = max(outer._seen, torch.cuda.max_memory_allocated(outer.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self._seen = 0
            if self.apart:  # meters nested in this block must not pass its peak outwards
                self._outer = _ACTIVE_CUDA[:]
                _ACTIVE_CUDA.clear()
            _ACTIVE_CUDA.append(self)
        else:
            if _ACTIVE:
                _fold(restart=True)  # the outer meters take what happened before this block
            else:
                _start_profiler()
            self._live = self.peak_bytes = 0
            if self.apart:  # until the exit, the events are this block's alone
                self._outer = _ACTIVE[:]
                _ACTIVE.clear()
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self.meter == "cuda_max_allocated":
            torch.cuda.synchronize(self.device)
            peak = max(self._seen, torch.cuda.max_memory_allocated(self.device))
            self.peak_bytes = max(0, peak - self._base)
            _ACTIVE_CUDA.remove(self)
            if self.apart:  # the enclosing meters' peaks resume from the level now
                torch.cuda.reset_peak_memory_stats(self.device)
                _ACTIVE_CUDA[:0], self._outer = self._outer, []
        elif self in _ACTIVE:
            try:
                _fold(restart=len(_ACTIVE) > 1 or bool(self._outer))
            finally:
                _ACTIVE.remove(self)
                for outer in self._outer:  # the net change only, never the block's peak
                    outer._live += self._live
                    outer.peak_bytes = max(outer.peak_bytes, outer._live)
                _ACTIVE[:0], self._outer = self._outer, []


__all__ = ["METERS", "PeakMemory", "meter_name", "rss_mb", "tensor_bytes"]
