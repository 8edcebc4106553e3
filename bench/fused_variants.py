"""The measurements behind the fused LoRA path's choices (``docs/fused-lora.md``), at preset
``cpu-fused`` size, one torch thread, all in one process:

1. variants of the fused side on the ``nf4`` and ``nf4+ckpt`` rows: the dequantized 4-bit weight
   kept from forward to backward or dequantized again (``KEEP_DEQUANTIZED``), and ``A x`` kept or
   recomputed (``KEEP_AX``) - median step time (process time) and peak memory, interleaved;
2. the shared down-projection product (``train.fused_lora: auto``: one ``x [A_q; A_k; A_v]`` and
   one ``x [A_gate; A_up]`` per block) against one product per layer (``unshared``), on the
   ``fp32``, ``bf16`` and ``nf4`` rows - median step time and peak memory, interleaved;
3. a per-operator CPU profile (torch.profiler) of one step of the plain path, the fused path and
   PEFT on the rows given (each profiled after one warm-up step; the fused products are shared
   from the first).

Run: ``flock /tmp/bench.lock env OMP_NUM_THREADS=1 PYTHONPATH=src python bench/fused_variants.py
OUT_DIR [row ...]``; writes ``OUT_DIR/variants.json`` and ``OUT_DIR/profile.md``.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rankwise.adapters.lora import fused
from rankwise_bench import llm_finetune as lf


def _set(flags):
    fused.KEEP_DEQUANTIZED, fused.KEEP_AX = flags[:2]


def measure(folder, row, s, data, variants):
    """``variants``: name -> (KEEP_DEQUANTIZED, KEEP_AX, shared products), each its own model."""
    from rankwise.recipes.session import set_fused_lora
    sides = {}
    for name, flags in variants.items():
        model, _ = lf.build_ours(folder, row, s, fused=True)
        if not flags[2]:  # one x A_i product per layer
            set_fused_lora(model, "unshared")
        sides[name] = (lf._Side(model, data, s, lf.ROWS[row][2]), flags)
    times = {n: [] for n in sides}
    for k in range(s.warmup + s.steps):
        order = list(sides) if k % 2 == 0 else list(sides)[::-1]
        for name in order:
            side, flags = sides[name]
            _set(flags)
            t0 = time.process_time()
            side.engine.train_step(k)
            if k >= s.warmup:
                times[name].append(time.process_time() - t0)
    out = {}
    for name, (side, flags) in sides.items():
        _set(flags)
        held, peak, _ = side.peak_bytes(s.warmup + s.steps)
        out[name] = {"step_s": statistics.median(times[name]), "peak_bytes": held + peak,
                     "step_peak_bytes": peak}
    _set((False, True, True))
    return out


def profile(folder, row, s, data, top=12):
    from torch.profiler import ProfilerActivity, profile as prof
    ours, _ = lf.build_ours(folder, row, s, fused=False)
    fz, _ = lf.build_ours(folder, row, s, fused=True)
    _, theirs, _ = lf.build_pair(folder, row, s)
    lines = [f"### {row}", ""]
    for name, model in (("plain", ours), ("fused", fz), ("peft", theirs)):
        side = lf._Side(model, data, s, lf.ROWS[row][2])
        side.engine.train_step(0)
        with prof(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
            side.engine.train_step(1)
        table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
        lines += [f"{name}:", "", "```", table, "```", ""]
    return "\n".join(lines)


def main(out: Path, rows: list[str]) -> None:
    import os
    s = lf.PRESETS[os.environ.get("FUSED_PRESET", "cpu-fused")]
    torch.set_num_threads(1)
    from transformers import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    data, _, _ = lf._windows(s)
    variants = {"dequantize-again+keep-Ax": (False, True, True),
                "keep-dequantized+keep-Ax": (True, True, True),
                "dequantize-again+recompute-Ax": (False, False, True)}
    stack = {"shared-product": (False, True, True), "product-per-layer": (False, True, False)}
    res = {"sizes": {"hidden": s.hidden, "layers": s.layers, "seq": s.seq, "batch": s.batch,
                     "steps": s.steps}, "timer": "process CPU time, 1 torch thread", "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        lf.build_base(s, Path(tmp))
        for row in ("nf4", "nf4+ckpt"):
            res["rows"][row] = measure(Path(tmp), row, s, data, variants)
            print(row, json.dumps(res["rows"][row]), flush=True)
        res["stack"] = {}
        for row in ("fp32", "bf16", "nf4"):
            res["stack"][row] = measure(Path(tmp), row, s, data, stack)
            print("stack", row, json.dumps(res["stack"][row]), flush=True)
        md = ["# Per-operator CPU profiles of one step (self CPU time), preset cpu-fused", ""]
        for row in rows:
            md.append(profile(Path(tmp), row, s, data))
    out.mkdir(parents=True, exist_ok=True)
    (out / "variants.json").write_text(json.dumps(res, indent=1))
    (out / "profile.md").write_text("\n".join(md))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or ["fp32", "bf16", "nf4"])
