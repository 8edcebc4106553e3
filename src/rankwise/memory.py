"""Peak memory of a block of work, measured the same way for every method."""
from __future__ import annotations

import os
import threading
import time

import torch


def rss_mb() -> float:
    """Current resident set size of this process in MiB (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return 0.0


class PeakMemory:
    """Context manager sampling memory while a block runs.

    On CUDA it reports ``torch.cuda.max_memory_allocated``; on CPU it samples the process's
    resident set size every ``interval`` seconds and reports the peak *above the level at entry*
    (so methods run one after another in one process are compared fairly).

    Attributes:
        peak_mb: The measured peak in MiB after the block ends.
    """

    def __init__(self, device: str = "cpu", interval: float = 0.005) -> None:
        self.device, self.interval, self.peak_mb = device, interval, 0.0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, rss_mb())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakMemory":
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated() / 2**20
        else:
            self._base = self._peak = rss_mb()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            self.peak_mb = torch.cuda.max_memory_allocated() / 2**20 - self._base
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self._peak, rss_mb()) - self._base
