"""``rankwise bench skrull``: Skrull scheduling against draw order and packing, 2 gloo processes.

Corpus: the standard library's ``.py`` files cut at their natural boundaries (each top-level
``def``/``class`` starts a new example), as bytes (a 256-token vocabulary), each cut at 4096
tokens: a long tail of short functions and a few long classes. A fixed sample of
``examples`` of them, the same for every row. Model: a 2-layer, 64-wide Llama with LoRA r 8
on every linear layer, AdamW. Rows, each ``torchrun --nproc-per-node 2`` on CPU (gloo):

* ``none``: the global step's examples in draw order, contiguous shares, ``grad_accum``
  padded micro-batches;
* ``packed``: ``data.packing`` blocks of 4096 tokens (the engine draws blocks);
* ``skrull``: the same examples as ``none``, scheduled (:mod:`rankwise.engine.skrull`).

Measured per row: real (unpadded) tokens per second of the two processes together over the
timed steps, and per process the seconds between the step's first collective (the target
count) and its second (the loss sums): the compute each process did, whose maximum the other
waits for. Balance = max / mean of those seconds. A second table times one process's step
eager vs ``torch.compile`` (inductor) on a fixed shape, with the losses of both.

Two processes on a machine whose cores other jobs share limit what any schedule can show:
the timings are ratios taken in the same run, under whatever load there was.
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from rankwise_bench.common import llama, worker_env, write_results

EXAMPLES, CAP, BATCH, ACCUM, STEPS, WARMUP = 256, 4096, 8, 2, 3, 1


def corpus(n: int = EXAMPLES, cap: int = CAP, seed: int = 0) -> list[list[int]]:
    """``n`` examples (byte ids + 1, 0 is padding) of stdlib source cut at top-level defs."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pieces: list[bytes] = []
    for f in sorted(root.glob("*.py")):
        text = f.read_bytes()
        pieces += [p for p in re.split(rb"\n(?=(?:def|class) )", text) if len(p) > 16]
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(pieces), size=min(n, len(pieces)), replace=False)
    return [[b + 1 for b in pieces[i][:cap]] for i in sorted(pick)]


class Examples(list):
    """The examples with the engine's ``pad_id`` and the ``lengths``/``rows`` packing reads."""

    pad_id, label_names, labels = 0, [], None

    def lengths(self) -> np.ndarray:
        return np.array([len(x["input_ids"]) for x in self])

    def rows(self, indices: list[int]) -> list[dict]:
        return [self[i] for i in indices]


def _model(seed: int = 0):
    from rankwise.adapters.lora import LoraConfig, apply_lora
    model = llama(257, 64, 2, 4, 128, kv_heads=2, positions=CAP, seed=seed, pad_token_id=0, use_cache=False)
    apply_lora(model, LoraConfig(r=8, targets="all-linear", dropout=0.0))
    return model


def worker(row: str, out: str) -> None:
    """One process of a row (under torchrun): train, time, write ``out.RANK.json``."""
    from rankwise.data.packing import PackedData
    from rankwise.engine import Engine
    from rankwise.tasks import CausalLMTask
    from rankwise.engine.distributed import setup, teardown
    from rankwise.engine.skrull import Skrull
    torch.set_num_threads(1)
    dist = setup("ddp", 300.0)
    marks: list[tuple[str, float]] = []
    all_sum, reduce_step = dist.all_sum, dist.reduce_step

    def timed_sum(values):
        r = all_sum(values)
        marks.append(("start", time.perf_counter()))
        return r

    def timed_reduce(*args):
        marks.append(("end", time.perf_counter()))
        return reduce_step(*args)

    dist.all_sum, dist.reduce_step = timed_sum, timed_reduce
    data = Examples({"input_ids": x} for x in corpus())
    model = _model()
    dist.prepare_model(model)
    train = PackedData(data, CAP) if row == "packed" else data
    batch = max(2 * ACCUM, len(train) * BATCH // len(data)) if row == "packed" else BATCH
    batch -= batch % (2 * ACCUM)
    schedule = Skrull.for_model(model, dist.world, dist.rank, ACCUM) if row == "skrull" else None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    eng = Engine(model, CausalLMTask(), opt, train, batch, seed=1, grad_accum=ACCUM, dist=dist,
                 schedule=schedule)
    busy, tokens, losses = [], 0, []
    for step in range(WARMUP + STEPS):
        marks.clear()
        if step == WARMUP:
            dist.barrier()
            began = time.perf_counter()
        res = eng.train_step(step)
        losses.append(res.loss)
        if step >= WARMUP:
            start = next(t for k, t in marks if k == "start")   # after the target count
            end = next(t for k, t in marks if k == "end")       # reduce_step sums again after
            busy.append(end - start)
            tokens += res.tokens
    wall = time.perf_counter() - began
    padded = sum(int(b["input_ids"].numel()) for s in range(WARMUP, WARMUP + STEPS)
                 for b in eng.step_batches(s))
    Path(f"{out}.{dist.rank}.json").write_text(json.dumps(
        {"busy_s": sum(busy), "wall_s": wall, "tokens": tokens, "padded_tokens": padded,
         "losses": losses, "batch": batch}))
    teardown()


def _row(row: str, tmp: Path) -> dict:
    env = worker_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "rankwise_bench.skrull", row, str(tmp / row)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    ranks = [json.loads((tmp / f"{row}.{r}.json").read_text()) for r in (0, 1)]
    busy = [r["busy_s"] for r in ranks]
    wall = max(r["wall_s"] for r in ranks)
    return {"row": row, "tokens_per_s": ranks[0]["tokens"] / wall, "wall_s": wall,
            "tokens": ranks[0]["tokens"], "padded_tokens": sum(r["padded_tokens"] for r in ranks),
            "busy_s": busy, "balance": max(busy) / (sum(busy) / len(busy)),
            "losses": ranks[0]["losses"], "global_batch": ranks[0]["batch"]}


def compile_rows(steps: int = 5) -> dict:
    """One process: a fixed-shape LoRA step eager vs inductor-compiled blocks (median of
    ``steps`` after the compiling step), and the first losses of both."""
    from rankwise.engine import Engine
    from rankwise.tasks import CausalLMTask
    from rankwise.engine.compile import compile_model
    torch.set_num_threads(1)
    data = Examples({"input_ids": x[:256]} for x in corpus() if len(x) >= 256)
    out = {}
    for kind in ("eager", "compiled"):
        model = _model()
        if kind == "compiled":
            compile_model(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        eng = Engine(model, CausalLMTask(), opt, data, 4, seed=1)
        t0 = time.perf_counter()
        first = eng.train_step(0).loss
        warm = time.perf_counter() - t0
        times, losses = [], [first]
        for s in range(1, steps + 1):
            t0 = time.perf_counter()
            losses.append(eng.train_step(s).loss)
            times.append(time.perf_counter() - t0)
        out[kind] = {"first_step_s": warm, "step_s": float(np.median(times)), "losses": losses}
    out["speedup"] = out["eager"]["step_s"] / out["compiled"]["step_s"]
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(out["eager"]["losses"], out["compiled"]["losses"]))
    return out


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    lines = ["# Skrull scheduling: 2 gloo processes, mixed-length stdlib source", "",
             f"{res['examples']} examples cut at top-level defs (bytes, <= {CAP} tokens; length "
             f"median {res['length_median']}, p90 {res['length_p90']}, max {res['length_max']}); "
             f"LoRA r 8 on a 2-layer 64-wide Llama; {STEPS} timed steps after {WARMUP}; global "
             f"batch {BATCH} examples (packed: blocks), grad_accum {ACCUM}. Host: {res['host']}.", "",
             "| row | tokens/s | vs none | padded tokens | busy s rank 0 / 1 | balance (max/mean) |",
             "|---|---|---|---|---|---|"]
    base = next(r for r in res["rows"] if r["row"] == "none")["tokens_per_s"]
    for r in res["rows"]:
        lines.append(f"| {r['row']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x | "
                     f"{r['padded_tokens']} (real {r['tokens']}) | {r['busy_s'][0]:.2f} / "
                     f"{r['busy_s'][1]:.2f} | {r['balance']:.3f} |")
    c = res["compile"]
    lines += ["", "## torch.compile (inductor), one process, LoRA step at 4 x 256 tokens", "",
              "| | first step s | step s (median) | losses |", "|---|---|---|---|"]
    for k in ("eager", "compiled"):
        lines.append(f"| {k} | {c[k]['first_step_s']:.1f} | {c[k]['step_s']:.3f} | "
                     + ", ".join(f"{x:.5f}" for x in c[k]["losses"]) + " |")
    lines += ["", f"compiled / eager step speed: {c['speedup']:.2f}x; max loss difference "
              f"{c['max_loss_diff']:.2e}.", "",
              "Two processes on a shared 2-core machine: timings are ratios from one run under "
              "the load of other jobs, and they bound the gain any schedule can show."]
    return "\n".join(lines) + "\n"


def run(out: Path) -> None:
    """Run every row; write ``out/results.json`` and ``out/results.md``."""
    import tempfile
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = np.array([len(x) for x in corpus()])
    res = {"examples": len(lengths), "length_median": int(np.median(lengths)),
           "length_p90": int(np.percentile(lengths, 90)), "length_max": int(lengths.max()),
           "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
           "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        res["rows"] = [_row(row, Path(tmp)) for row in ("none", "packed", "skrull")]
    res["compile"] = compile_rows()
    write_results(out, res, markdown(res))


if __name__ == "__main__":  # a torchrun worker: python -m rankwise_bench.skrull ROW OUT
    worker(sys.argv[1], sys.argv[2])
