"""Benchmark: the data pipeline at 100k and 1M records (``rankwise bench data-pipeline``).

Records have one shape at every size: the ``stdlib-functions`` prompt-completion pairs (a
standard-library docstring -> its ``def`` line), cycled, each prompt tagged with its record
number so no two are equal. They are written as JSONL under the system temp folder and deleted
afterwards. Each size runs in a fresh process (so one size's memory cannot hide in another's):

1. ``datasets`` converts the JSONL to Arrow (``convert_s``);
2. :func:`rankwise.data.text.build_data` tokenizes every record with one ``Dataset.map`` pass
   (``tokenize_s``, records/s and tokens/s), then again from its cache (``cached_s``);
3. the training split is packed into ``max_length`` blocks (``pack_s``);
4. a tiny Llama (LoRA) trains ``STEPS`` steps of ``TRAIN_BATCH`` packed, memory-mapped blocks.

Resident memory is sampled every 5 ms from ``/proc/self/status``: ``RssAnon`` (heap: Python
objects, tensors, Arrow buffers read into memory) and ``RssFile`` (pages of memory-mapped files
the process has touched; the kernel may drop them, they are not owned by the process). Peaks
are reported for data preparation and for training. The peer is the pre-``datasets`` pipeline
(every record a Python dict, every token list a Python list), run the same way.

The target (issue 10): resident memory stays flat in the number of records, peak RSS at 1M at
most ``RSS_TARGET`` times that at 100k, for data preparation and for training alike; the
Markdown states the ratios and whether they held.

Pad fractions (the share of computed positions that are padding) use batches of ``BATCH`` in
one shuffled pass over the training examples (unpacked) or the blocks (packed).
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from rankwise_bench.common import worker_env, write_results

SIZES = (100_000, 1_000_000)
MAX_LENGTH, BATCH, STEPS, TRAIN_BATCH = 128, 32, 5, 8  # TRAIN_BATCH: blocks per training step
RSS_TARGET = 1.2  # peak RSS at SIZES[1] / at SIZES[0], at most


def memory_mb() -> dict[str, float]:
    """``RssAnon`` and ``RssFile`` of this process in MiB (Linux; zeros elsewhere)."""
    out = {"anon": 0.0, "file": 0.0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:")):
                    out["anon" if line.startswith("RssAnon") else "file"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


class Sampler:
    """Peak ``RssAnon``, ``RssFile`` and their sum while a block runs (5 ms samples)."""

    def __enter__(self) -> "Sampler":
        self.peak = {"anon": 0.0, "file": 0.0, "total": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            m = memory_mb()
            for k, v in (("anon", m["anon"]), ("file", m["file"]), ("total", m["anon"] + m["file"])):
                self.peak[k] = max(self.peak[k], v)
            if self._stop.wait(0.005):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def write_records(path: Path, n: int) -> None:
    """Write ``n`` prompt-completion records of the benchmark's shape as JSONL."""
    from rankwise.data.instruct import load_function_records
    base = load_function_records()
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            r = base[i % len(base)]
            f.write(json.dumps({"prompt": f"[{i}] {r['prompt']}", "completion": r["completion"]}) + "\n")


def pad_fraction(lengths: np.ndarray, batch: int, seed: int = 0) -> float:
    """Padding share of one shuffled pass in batches of ``batch`` (each padded to its longest)."""
    lengths = np.random.default_rng(seed).permutation(lengths[lengths > 0])
    full = len(lengths) // batch * batch
    rows = lengths[:full].reshape(-1, batch)                         # (batches, batch)
    computed = int((rows.max(1) * batch).sum())
    return round(1.0 - int(rows.sum()) / max(computed, 1), 4)


def _rankwise_worker(path: Path, cache: Path) -> dict:
    import torch

    from rankwise.data.files import read_dataset
    from rankwise.data.packing import PackedData
    from rankwise.data.text import build_data
    from rankwise.engine import Engine, get_task
    from rankwise.recipes.config import DataConfig
    from rankwise.recipes.model import load_model
    import rankwise
    torch.set_num_threads(1)
    task = get_task("causal-lm")
    model, tok = load_model("tiny-llama", task, seed=0)
    rankwise.apply(model, "lora", r=4)
    cfg = DataConfig(source=str(path), format="prompt-completion", max_length=MAX_LENGTH,
                     eval_fraction=0.01, cache_dir=str(cache))
    res: dict = {"baseline": memory_mb()}
    with Sampler() as prep:
        t = time.perf_counter()
        read_dataset(path, str(cache))
        res["convert_s"] = time.perf_counter() - t
        t = time.perf_counter()
        train, evals = build_data(cfg, task, tok)
        res["tokenize_s"] = time.perf_counter() - t
        t = time.perf_counter()
        build_data(cfg, task, tok)
        res["cached_s"] = time.perf_counter() - t
        t = time.perf_counter()
        packed = PackedData(train, MAX_LENGTH)
        res["pack_s"] = time.perf_counter() - t
    lengths = train.lengths()
    blocks = np.add.reduceat(lengths[packed.order], packed.starts[:-1])   # tokens per block
    opt = rankwise.optimizer(model, "adamw", lr=1e-3)
    engine = Engine(model, task, opt, packed, TRAIN_BATCH, seed=0)
    with Sampler() as fit:
        t = time.perf_counter()
        losses = [engine.train_step(s).loss for s in range(STEPS)]
        res["step_s"] = (time.perf_counter() - t) / STEPS
    n = len(train) + len(evals) + train.dropped + evals.dropped
    res.update(records=n, train_examples=len(train), tokens=int(lengths.sum()),
               records_per_s=n / res["tokenize_s"], tokens_per_s=int(lengths.sum()) / res["tokenize_s"],
               blocks=len(packed), pad_unpacked=pad_fraction(lengths, BATCH),
               pad_packed=pad_fraction(blocks, BATCH), losses=losses,
               peak_prep=prep.peak, peak_train=fit.peak, after=memory_mb())
    return res


def _lists_worker(path: Path, cache: Path) -> dict:
    """The peer: records and token ids as Python objects (rankwise's pipeline before datasets)."""
    from rankwise.recipes.model import load_tokenizer
    tok = load_tokenizer("tiny-llama")
    res: dict = {"baseline": memory_mb()}
    with Sampler() as prep:
        t = time.perf_counter()
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        ids = []
        for k in range(0, len(records), 1000):
            chunk = records[k:k + 1000]
            ids += tok([r["prompt"] + r["completion"] for r in chunk], truncation=True,
                       max_length=MAX_LENGTH)["input_ids"]
        res["tokenize_s"] = time.perf_counter() - t
    res.update(records=len(records), records_per_s=len(records) / res["tokenize_s"],
               peak_prep=prep.peak, after=memory_mb())
    return res


def _worker(kind: str, n: int, folder: Path) -> dict:
    """Run one measurement in a fresh interpreter and return its JSON result."""
    result = folder / f"{kind}-{n}.json"
    env = worker_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "rankwise_bench.data_pipeline", kind, str(folder / f"{n}.jsonl"),
           str(folder / f"cache-{kind}-{n}"), str(result)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker for {n} records failed:\n{proc.stderr[-3000:]}")
    return json.loads(result.read_text())


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    rows, lists = res["rankwise"], res["python_lists"]
    small, big = (str(n) for n in SIZES)
    out = ["# Data pipeline: 100k vs 1M prompt-completion records", "",
           f"`rankwise bench data-pipeline`; {res['machine']}; max_length {MAX_LENGTH}, batch {BATCH}, "
           "one torch thread, each size in a fresh process.", "",
           "| measure | 100k | 1M | 1M / 100k |", "|---|---:|---:|---:|"]

    def row(name, fn, fmt="{:,.1f}"):
        a, b = fn(rows[small]), fn(rows[big])
        out.append(f"| {name} | {fmt.format(a)} | {fmt.format(b)} | {b / a:.2f} |")

    row("JSONL -> Arrow, s", lambda r: r["convert_s"])
    row("tokenize (one map pass), s", lambda r: r["tokenize_s"])
    row("tokenize, records/s", lambda r: r["records_per_s"], "{:,.0f}")
    row("tokenize, tokens/s", lambda r: r["tokens_per_s"], "{:,.0f}")
    row("reload from cache, s", lambda r: r["cached_s"], "{:,.2f}")
    row("pack, s", lambda r: r["pack_s"], "{:,.2f}")
    row(f"train step ({TRAIN_BATCH} packed blocks), s", lambda r: r["step_s"], "{:,.3f}")
    row("baseline RSS (imports, model), MiB", lambda r: r["baseline"]["anon"] + r["baseline"]["file"])
    row("peak RSS, data preparation, MiB", lambda r: r["peak_prep"]["total"])
    row("  of which anonymous (heap), MiB", lambda r: r["peak_prep"]["anon"])
    row("  of which mapped files, MiB", lambda r: r["peak_prep"]["file"])
    row("peak RSS, training, MiB", lambda r: r["peak_train"]["total"])
    row("  of which anonymous (heap), MiB", lambda r: r["peak_train"]["anon"])
    row("  of which mapped files, MiB", lambda r: r["peak_train"]["file"])
    row("pad fraction, unpacked", lambda r: r["pad_unpacked"], "{:.3f}")
    row("pad fraction, packed", lambda r: r["pad_packed"], "{:.3f}")
    verdict = []
    for what, key in (("data preparation", "rss_ratio_prep"), ("training", "rss_ratio_train")):
        ratio = res[key]
        verdict.append(f"{what} {ratio:.2f}x ({'held' if ratio <= RSS_TARGET else 'not held'})")
    out += ["", f"Target: peak RSS (anonymous + mapped files) at 1M at most {RSS_TARGET}x that at 100k. "
            f"Result: {'; '.join(verdict)}.",
            "Mapped-file pages are the Arrow files' pages the process has touched; the pipeline "
            "releases them as it goes (`rankwise.data.files.release_pages`), so they do not add up "
            "over the records."]
    a, b = lists[small]["peak_prep"]["total"], lists[big]["peak_prep"]["total"]
    out += ["", "Peer, records and token ids as Python objects (the pipeline before `datasets`):", "",
            "| measure | 100k | 1M | 1M / 100k |", "|---|---:|---:|---:|",
            f"| peak RSS, MiB | {a:,.1f} | {b:,.1f} | {b / a:.2f} |",
            f"| records/s | {lists[small]['records_per_s']:,.0f} | {lists[big]['records_per_s']:,.0f} | |"]
    return "\n".join(out) + "\n"


def run(out: Path) -> dict:
    """Run the benchmark and write ``out/results.json`` and ``out/results.md``.

    Args:
        out: Output folder.

    Returns:
        The results (per size: times, throughput, memory peaks, pad fractions).
    """
    out = Path(out)
    folder = Path(tempfile.mkdtemp(prefix="rankwise-data-pipeline-"))
    try:
        res: dict = {"machine": f"Python {platform.python_version()}, {platform.machine()}, "
                                f"{os.cpu_count()} cores", "rankwise": {}, "python_lists": {}}
        for n in SIZES:
            write_records(folder / f"{n}.jsonl", n)
            res["rankwise"][str(n)] = _worker("rankwise", n, folder)
            res["python_lists"][str(n)] = _worker("lists", n, folder)
            (folder / f"{n}.jsonl").unlink()
            shutil.rmtree(folder / f"cache-rankwise-{n}", ignore_errors=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    small, big = res["rankwise"][str(SIZES[0])], res["rankwise"][str(SIZES[1])]
    res["rss_ratio_prep"] = big["peak_prep"]["total"] / small["peak_prep"]["total"]
    res["rss_ratio_train"] = big["peak_train"]["total"] / small["peak_train"]["total"]
    res["anon_ratio_prep"] = big["peak_prep"]["anon"] / small["peak_prep"]["anon"]
    res["rss_target"] = RSS_TARGET
    res["rss_target_held"] = max(res["rss_ratio_prep"], res["rss_ratio_train"]) <= RSS_TARGET
    write_results(out, res, markdown(res))
    return res


if __name__ == "__main__":  # a worker: KIND JSONL CACHE RESULT
    kind, src, cache_dir, dest = sys.argv[1:5]
    fn = _rankwise_worker if kind == "rankwise" else _lists_worker
    Path(dest).write_text(json.dumps(fn(Path(src), Path(cache_dir))))
