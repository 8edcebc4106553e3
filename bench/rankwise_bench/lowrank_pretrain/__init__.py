"""``rankwise bench lowrank-pretrain``: pre-train a Llama-style model on the Python standard
library's source with every low-rank optimizer and the peers ``galore-torch`` and ``apollo-torch``
(and ``torch.optim.Muon`` as a reference), in one process.

Data (:mod:`.data`): the interpreter's standard library as raw UTF-8 **bytes** (vocabulary 256,
so perplexity is per byte), split by module name. Every row (:mod:`.rows`) sees the same initial
weights, the same batches in the same order and the same schedule (10% linear warm-up, cosine to
10%), over a small learning-rate grid of its own; the best learning rate by held-out loss is
reported. Runs are interleaved (all rows at the first learning rate, then the second...) so that
load from other processes spreads over all of them and step-time ratios to AdamW are measured
under the same conditions. Steps run through the shared :class:`rankwise.engine.Engine` with the
``causal-lm`` task (:mod:`.harness`). Sizes are presets (``small`` on CPU by default, ``medium``,
``1b`` on a GPU in bf16): ``rankwise bench lowrank-pretrain --size 1b ...``.
"""
from __future__ import annotations

import importlib.util
import math
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from rankwise.errors import RankwiseError
from rankwise_bench.common import torch_threads, write_results
from rankwise_bench.corpus import corpus_windows
from rankwise_bench.lowrank_pretrain.harness import (build_model, counted_state_bytes, heldout_loss,
                                                     median, peak_tensor_mib, prepared_model, train_one)
from rankwise_bench.lowrank_pretrain.report import markdown, plot
from rankwise_bench.lowrank_pretrain.rows import METHODS, ROWS, SIZES, Row, Sizes, sizes

__all__ = ["main", "markdown", "METHODS", "ROWS", "Row", "SIZES", "Sizes", "build_model", "counted_state_bytes",
           "heldout_loss", "prepared_model", "run", "sizes", "train_one"]


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench lowrank-pretrain --out DIR [--size S] [--rows a,b] [--set FIELD=VALUE ...]``
    (:mod:`.__main__`)."""
    from rankwise_bench.lowrank_pretrain.__main__ import main as command
    return command(argv)


def _ratios(methods: tuple[str, ...], runs: list[dict]) -> dict:
    def avg(m, key):
        vals = [r[key] for r in runs if r["method"] == m and not r["diverged"]]
        return sum(vals) / max(len(vals), 1)
    # Forward+backward is the same work for every row; under a shared machine its time is mostly
    # noise from other processes, so a second ratio uses one common (median) value for it.
    fb = median([r["fwd_bwd_median_s"] for r in runs if not r["diverged"]])
    return {m: {"step": avg(m, "step_s") / avg("adamw", "step_s"),
                "step_common_fb": (fb + avg(m, "opt_step_s")) / (fb + avg("adamw", "opt_step_s")),
                "opt_step": avg(m, "opt_step_s") / avg("adamw", "opt_step_s"),
                "refresh_step_ms": max(r["max_opt_step_s"] for r in runs if r["method"] == m) * 1e3}
            for m in methods}


def run(out: Path, sizes: Sizes | None = None, methods: tuple[str, ...] = METHODS) -> dict:
    """Run the benchmark and write ``results.json``, ``results.md`` and ``loss_curves.png``.

    Args:
        out: Output folder (created).
        sizes: Override the default :class:`Sizes` (a preset of :data:`SIZES`, tests a tiny one).
        methods: Which rows of :data:`ROWS` to run (``adamw`` is always included: it is the
            time base; a row whose ``requires`` is not installed is left out).

    Returns:
        The results dict written to ``results.json``.

    Raises:
        RankwiseError: If a name in ``methods`` is not a row, or the device is not available.
    """
    s = sizes or Sizes()
    unknown = [m for m in methods if m not in ROWS]
    if unknown:
        raise RankwiseError(f"lowrank-pretrain rows: got {unknown}; expected some of {list(ROWS)}")
    if s.device.startswith("cuda") and not torch.cuda.is_available():
        raise RankwiseError(f"lowrank-pretrain device {s.device!r}: no CUDA device here; set device=cpu")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    with torch_threads(s.threads):
        train_windows, heldout, info, _, _ = corpus_windows(s.seq, s.steps, s.batch, s.eval_windows, s.seed)
        methods = tuple(m for m in dict.fromkeys(("adamw",) + tuple(methods))
                        if ROWS[m].requires is None or importlib.util.find_spec(ROWS[m].requires))
        grids = {m: ROWS[m].grid(s) for m in methods}
        runs = []
        for i in range(max(len(grid) for grid in grids.values())):
            for m in methods:
                if i < len(grids[m]):
                    runs.append(train_one(m, grids[m][i], s, train_windows, heldout))
        best = {}
        for m in methods:
            ok = [r for r in runs if r["method"] == m and math.isfinite(r["heldout_loss"])]
            best[m] = min(ok, key=lambda r: r["heldout_loss"]) if ok else [r for r in runs if r["method"] == m][0]
            best[m]["peak_mib"] = peak_tensor_mib(m, best[m]["lr"], s, train_windows)
    ratios = _ratios(methods, runs)
    result = {
        "sizes": asdict(s), "corpus": info, "tokenizer": "bytes (vocab 256)",
        "model_params": sum(p.numel() for p in build_model(replace(s, device="meta")).parameters()),
        "python": platform.python_version(), "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} cores visible".strip(),
        "wall_s": time.time() - t_start, "step_time_ratio_to_adamw": ratios,
        "rows": {m: {"optimizer": ROWS[m].optimizer, "overrides": ROWS[m].overrides, "method": ROWS[m].method,
                     "lrs": list(grids[m])} for m in methods},
        "best": {m: {k: v for k, v in r.items() if k != "train_curve"} for m, r in best.items()},
        "runs": runs,
    }
    if s.device.startswith("cuda"):
        result["machine"] += f", {torch.cuda.get_device_name()}"
    try:
        import galore_torch  # noqa: F401
        from importlib.metadata import version
        result["peer"] = {"galore-torch": version("galore-torch"), "bitsandbytes": version("bitsandbytes")}
        if importlib.util.find_spec("apollo_torch"):
            result["peer"]["apollo-torch"] = version("apollo-torch")
    except Exception:  # pragma: no cover - the peer is a bench-only extra
        result["peer"] = None
    write_results(out, result, markdown(result))
    plot(best, runs, out / "loss_curves.png")
    return result


