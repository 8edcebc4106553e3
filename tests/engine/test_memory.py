"""The shared memory meter: exact live-tensor peaks on CPU, across flushes, nested blocks and
the per-step folds of a fit."""
from __future__ import annotations

import torch

from rankwise.memory import PeakMemory, meter_name, tensor_bytes

MB4 = 1000 * 1000 * 4  # bytes of a float32 1000 x 1000 tensor


def test_cpu_meter_counts_live_tensor_bytes_above_the_start():
    before = torch.ones(1000, 1000)  # live before the block: not counted
    keep = []
    with PeakMemory("cpu") as outer:
        keep.append(torch.ones(1000, 1000))          # +4 MB, kept
        outer.flush()                                # events folded mid-block, level carried over
        tmp = torch.ones(2000, 1000)                 # +8 MB, freed
        del tmp
        with PeakMemory("cpu") as inner:
            a = torch.ones(500, 1000)                # +2 MB, freed
            del a
            keep.append(torch.ones(250, 1000))       # +1 MB, kept
    assert outer.meter == inner.meter == meter_name("cpu") == "cpu_live_tensors"
    assert outer.peak_bytes == MB4 + 2 * MB4         # 4 MB kept + 8 MB transient
    assert inner.peak_bytes == MB4 // 2              # its own block only
    del before


def test_tensor_bytes_counts_each_storage_once():
    lin = torch.nn.Linear(10, 10)
    t = torch.ones(100)
    assert tensor_bytes(lin) == (100 + 10) * 4
    assert tensor_bytes(t, t[10:], {"state": {"m": t}}) == 400


def test_a_fit_folds_the_meter_after_every_step_and_peaks_at_one_steps_transient(monkeypatch):
    """Each step allocates and frees 4 MB (a loss hook); the toy model, its gradients and
    activations add a few KB. Folding after every step (MeasureMemory) carries the live level
    over, so the peak is one step's 4 MB, not the three steps' 12 MB."""
    from engine_helpers import engine

    from rankwise import memory
    from rankwise.engine.callbacks import MeasureMemory
    folds = []
    fold = memory._fold
    monkeypatch.setattr(memory, "_fold", lambda restart: (folds.append(restart), fold(restart))[1])

    def transient(model, step):
        big = torch.ones(1000, 1000)                 # 4 MB, freed when the step ends
        return big.sum() * 0
    with PeakMemory("cpu") as meter:
        engine(loss_hooks={"big": transient}, callbacks=[MeasureMemory(meter)], grad_accum=2).fit(3)
    assert folds == [True, True, True, False]        # one fold per step, then the final one
    assert MB4 <= meter.peak_bytes < MB4 + 64 * 1024
