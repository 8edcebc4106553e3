"""``rankwise bench plan``: ``rankwise plan``'s predicted peak against the shared memory meter.

For every row a small Llama is written to a temporary folder (config + seeded random weights),
``plan`` predicts the peak from the run config alone (meta device), and then the same run is
built as ``rankwise train`` builds it (``load_model``, the method's registration, float32
trainable weights, checkpointing, the optimizer's registration) and stepped by the engine on
windows of the standard library's source. Measured peak = bytes of the model's tensors
(quantization state included) and the optimizer state + the peak one more step adds above them
(:mod:`rankwise.memory`'s meter) - the definition of ``bench llm-finetune``; the step measured
is the third, so the optimizer state exists.

Rows: every ``llm-finetune`` row (LoRA r=16 on all linear layers, AdamW: fp32, bf16,
bf16+ckpt, nf4, nf4+ckpt), full fine-tuning with AdamW (fp32, bf16 autocast, checkpointing)
and GaLore, a mixture adapter (moe-lora), accumulation, a large vocabulary (logits-dominated),
a longer sequence, and a BERT-style classifier (tiny-bert, LoRA on query/value, built by
``prepare`` on the demo data). The rows of :data:`DIST_ROWS` run the same model under
``torchrun --nproc-per-node 2`` (gloo, FSDP2 and ddp; ``train.batch_size`` is the global batch)
and compare one process's peak with ``plan --nproc 2``.
"""
from __future__ import annotations

import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rankwise.core import atomic
from rankwise_bench.common import llama, ordered, worker_env, write_results

LORA = {"name": "lora", "r": 16, "alpha": 32, "targets": "all-linear"}
SHAPE = dict(hidden=128, layers=3, heads=4, kv=2, intermediate=352, vocab=256, seq=128, batch=4)
ROWS: dict[str, dict[str, Any]] = {
    "lora fp32": {},
    "lora bf16": {"dtype": "bfloat16", "precision": "bf16"},
    "lora bf16+ckpt": {"dtype": "bfloat16", "precision": "bf16", "ckpt": True},
    "lora nf4": {"dtype": "bfloat16", "precision": "bf16", "quantize": "nf4"},
    "lora nf4+ckpt": {"dtype": "bfloat16", "precision": "bf16", "quantize": "nf4", "ckpt": True},
    "full adamw fp32": {"method": {"name": "full"}},
    "full adamw bf16 autocast": {"method": {"name": "full"}, "precision": "bf16"},
    "full adamw fp32+ckpt": {"method": {"name": "full"}, "ckpt": True},
    "full galore fp32": {"method": {"name": "full"}, "optim": {"name": "galore", "rank": 32}},
    "moe-lora bf16": {"dtype": "bfloat16", "precision": "bf16",
                      "method": {"name": "moe-lora", "num_experts": 4, "top_k": 2, "r": 4,
                                 "targets": "all-linear"}},
    "lora fp32 accum 2": {"accum": 2},
    "lora fp32 vocab 8192": {"shape": {"vocab": 8192}},
    "bert lora classification": {"bert": True},
    "lora bf16 seq 512 ckpt": {"dtype": "bfloat16", "precision": "bf16", "ckpt": True,
                               "shape": {"seq": 512, "batch": 2}},
    "lora fp32 vocab 8192 chunked": {"shape": {"vocab": 8192}, "chunk": 128},
    "full adamw 8-bit state": {"method": {"name": "full"},
                               "optim": {"name": "adamw", "lr": 1e-3, "state_bits": 8}},
    "full adamw per-layer": {"method": {"name": "full"},
                             "optim": {"name": "adamw", "lr": 1e-3, "per_layer": True}},
    "full galore 8-bit per-layer": {"method": {"name": "full"},
                                    "optim": {"name": "galore", "rank": 32, "state_bits": 8,
                                              "per_layer": True}},
}


# One process's peak under ``torchrun --nproc-per-node 2`` (gloo on CPU), against ``plan --nproc 2``.
DIST_ROWS: dict[str, dict[str, Any]] = {
    "full adamw fp32 fsdp x2": {"method": {"name": "full"}, "distributed": "fsdp"},
    "lora fp32 fsdp x2": {"distributed": "fsdp"},
    "full adamw fp32 ddp x2": {"method": {"name": "full"}, "distributed": "ddp"},
    # weights, gradients and state, not activations, dominate: the gathered blocks show
    "full adamw fp32 fsdp x2 wide": {"method": {"name": "full"}, "distributed": "fsdp",
                                     "shape": {"hidden": 512, "heads": 8, "kv": 8,
                                               "intermediate": 1408, "layers": 2, "seq": 16,
                                               "batch": 2}},
}
NPROC = 2
DIST_REPEATS = 3  # steps measured per process (the largest peak kept)


def _write_model(folder: Path, shape: dict, seed: int = 0) -> None:
    llama(shape["vocab"], shape["hidden"], shape["layers"], shape["heads"], shape["intermediate"],
          kv_heads=shape["kv"], positions=max(512, shape["seq"]), seed=seed, bos_token_id=0, eos_token_id=0,
          pad_token_id=0, tie_word_embeddings=False, use_cache=False).save_pretrained(folder)
    from rankwise.recipes.model import load_tokenizer
    load_tokenizer("tiny-llama").save_pretrained(folder)  # load_model wants one beside the weights


def run_config(folder: Path, row: dict, shape: dict) -> dict:
    """The raw run config of a row (what a user's YAML would hold)."""
    return {"model": {"path": str(folder), "dtype": row.get("dtype", "float32"),
                      "quantize": row.get("quantize")},
            "task": {"name": "causal-lm"},
            "data": {"max_length": shape["seq"]},
            "method": row.get("method", LORA),
            "optim": row.get("optim", {"name": "adamw", "lr": 1e-3}),
            "train": {"batch_size": shape["batch"], "grad_accum": row.get("accum", 1),
                      "precision": row.get("precision", "fp32"),
                      "gradient_checkpointing": row.get("ckpt", False), "grad_clip": 0,
                      **({"loss_chunk_tokens": row["chunk"]} if "chunk" in row else {}),
                      **({"distributed": row["distributed"]} if "distributed" in row else {})}}


BERT = {"model": {"path": "tiny-bert"}, "task": {"name": "classification"},
        "data": {"source": "demo", "max_length": 32, "limit": 256},
        "method": {"name": "lora", "r": 4, "targets": ["query", "value"]},
        "optim": {"name": "adamw", "lr": 5e-3}, "train": {"batch_size": 16, "progress": False}}


def measure_prepared(cfg, steps: int = 2, device: str = "cpu") -> dict:
    """A BERT-style row: built by ``prepare`` itself (demo data, padded to the batch's
    longest text). Short texts make the batch padded, so the attention gets a mask; on CPU
    that runs SDPA's math path, which saves the ``(B, heads, T, T)`` probabilities plan does
    not count (it counts the fused kernels): the row shows that gap."""
    from rankwise.core.quant import model_bytes
    from rankwise.memory import PeakMemory, tensor_bytes
    from rankwise.recipes.session import prepare
    session = prepare(cfg, device=device)
    engine = session.engine()
    for k in range(steps):
        engine.train_step(k)
    weights = model_bytes(session.model)
    state = tensor_bytes(dict(session.optimizer.state))
    width = session.batch(steps)["input_ids"].shape[1]
    with PeakMemory(device) as mem:
        engine.train_step(steps)
    return {"weights_bytes": weights, "state_bytes": state, "step_peak_bytes": mem.peak_bytes,
            "peak_bytes": weights + state + mem.peak_bytes, "meter": mem.meter, "batch_width": width}


def _local_bytes(*objects) -> int:
    """:func:`rankwise.memory.tensor_bytes` of this process's part: FSDP2's DTensors count their
    local shard (its padded storage)."""
    from torch.distributed.tensor import DTensor

    from rankwise.memory import tensor_bytes
    found: list[torch.Tensor] = []

    def walk(obj) -> None:
        if isinstance(obj, torch.Tensor):
            found.append(obj.to_local() if isinstance(obj, DTensor) else obj)
        elif isinstance(obj, torch.nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                walk(t)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
    walk(list(objects))
    return tensor_bytes(*found) if found else 0


def measure(cfg, shape: dict, steps: int = 2, dist=None, repeats: int = 1, device: str = "cpu") -> dict:
    """Build the run as ``prepare`` does and measure one step after ``steps`` warm-up steps
    (under torchrun: this process's share, the model prepared by ``dist`` as ``prepare`` does;
    ``repeats`` steps measured, the largest peak kept: gloo's communication threads allocate
    while the main thread runs, so the peak of one step depends on their timing)."""
    from rankwise import registry
    from rankwise_bench.corpus import ByteWindows, load_corpus
    from rankwise.core.quant import model_bytes
    from rankwise.engine import Engine, get_task
    from rankwise.memory import PeakMemory, tensor_bytes
    from rankwise.recipes.model import enable_checkpointing, load_model
    task = get_task("causal-lm")
    m = cfg.model
    model, _ = load_model(m.path, task, dtype=m.dtype, quantize=m.quantize,
                          double_quant=m.double_quant, device=device)
    torch.manual_seed(0)
    registry.get("method", cfg.method.name).apply(model, cfg.method, "default")
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    if cfg.train.gradient_checkpointing:
        enable_checkpointing(model)
    if dist is not None:
        model = dist.prepare_model(model)
    opt = registry.get("optimizer", cfg.optim.name).builder(model, cfg.optim)
    train, _, _ = load_corpus()
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(train) - shape["seq"], (shape["batch"] * (steps + repeats),), generator=g)
    data = ByteWindows(train, starts, shape["seq"])
    task.loss_chunk_tokens = cfg.train.loss_chunk_for(model.config.vocab_size)  # as rankwise train
    engine = Engine(model, task, opt, data, cfg.train.batch_size, seed=0,
                    grad_accum=cfg.train.grad_accum, precision=cfg.train.precision, device=device,
                    per_layer=getattr(cfg.optim, "per_layer", False), dist=dist)
    for k in range(steps):
        engine.train_step(k)
    if dist is not None and dist.active:
        weights, state = _local_bytes(model), _local_bytes(dict(opt.state))
    else:
        weights, state = model_bytes(model), tensor_bytes(dict(opt.state))
    peaks = []
    for k in range(steps, steps + repeats):
        with PeakMemory(device) as mem:
            engine.train_step(k)
        peaks.append(mem.peak_bytes)
    return {"weights_bytes": weights, "state_bytes": state, "step_peak_bytes": max(peaks),
            "peak_bytes": weights + state + max(peaks), "meter": mem.meter,
            **({"step_peaks_bytes": peaks} if repeats > 1 else {})}


def dist_worker(spec_path: Path) -> None:
    """One torchrun process: measure every row of the spec, write ``rank<R>.json`` beside it."""
    import os

    from transformers import logging as hf_logging

    from rankwise.engine.distributed import Distributed, setup, teardown
    from rankwise.recipes import plan as P
    from rankwise.recipes.config import build_run_config
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    joined = setup("ddp", 300.0)
    out = {}
    try:
        for name, item in spec["rows"].items():
            cfg = build_run_config(P.split_switches(item["config"])[0])
            dist = Distributed(joined.rank, joined.world, joined.local_rank, cfg.train.distributed, 300.0)
            out[name] = measure(cfg, item["shape"], dist=dist, repeats=DIST_REPEATS)
            dist.barrier()
    finally:
        teardown()
    rank = os.environ.get("RANK", "0")
    atomic.write_json(Path(spec_path).parent / f"rank{rank}.json", out)


def run_dist_rows(names: list[str], tmp: Path) -> dict:
    """Predict (``plan --nproc 2``) and measure (``torchrun --nproc-per-node 2``, gloo) the
    rows of :data:`DIST_ROWS`: the per-process peak is the larger of the two processes'."""
    import subprocess
    import sys

    from rankwise.recipes import plan as P
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.planner import Planner
    spec, preds = {"rows": {}}, {}
    for name in names:
        row = DIST_ROWS[name]
        shape = {**SHAPE, **row.get("shape", {})}
        folder = tmp / "-".join(f"{k}{v}" for k, v in sorted(shape.items()))
        if not folder.exists():
            _write_model(folder, shape)
        raw = run_config(folder, row, shape)
        data, switches = P.split_switches(raw)
        preds[name] = Planner(build_run_config(data), switches, "cpu", nproc=NPROC).estimate()
        spec["rows"][name] = {"config": raw, "shape": shape}
    work = tmp / "dist"
    work.mkdir(exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec))
    env = worker_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={NPROC}", "-m", "rankwise_bench.plan", "--worker",
                           str(work / "spec.json")], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed: {proc.stderr[-3000:]}")
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(NPROC)]
    out = {}
    for name in names:
        per = [r[name] for r in ranks]
        got = max(per, key=lambda r: r["peak_bytes"])
        est = preds[name]
        shape = spec["rows"][name]["shape"]
        out[name] = {"config": run_config(Path("MODEL"), DIST_ROWS[name], shape), "shape": shape,
                     "processes": NPROC, "predicted": est.to_json(), "predicted_peak_bytes": est.peak,
                     "predicted_weights_bytes": est.weights + est.trainable,
                     "predicted_state_bytes": est.optimizer_state, **got,
                     "per_process_peak_bytes": [r["peak_bytes"] for r in per],
                     "ratio": est.peak / got["peak_bytes"]}
    return out


def run_row(name: str, tmp: Path, device: str = "cpu") -> dict:
    """Predict and measure one row."""
    from rankwise.recipes import plan as P
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.planner import Planner
    row = ROWS[name]
    shape = {**SHAPE, **row.get("shape", {})}
    folder = tmp / "-".join(f"{k}{v}" for k, v in sorted(shape.items()))
    if not folder.exists() and not row.get("bert"):
        _write_model(folder, shape)
    raw = BERT if row.get("bert") else run_config(folder, row, shape)
    data, switches = P.split_switches(raw)
    cfg = build_run_config(data)
    est = Planner(cfg, switches, device, padded=bool(row.get("bert"))).estimate()
    got = measure_prepared(cfg, device=device) if row.get("bert") else measure(cfg, shape, device=device)
    return {"config": raw if row.get("bert") else run_config(Path("MODEL"), row, shape),
            "shape": None if row.get("bert") else shape,
            "predicted": est.to_json(), "predicted_peak_bytes": est.peak,
            "predicted_weights_bytes": est.weights + est.trainable,
            "predicted_state_bytes": est.optimizer_state, **got,
            "ratio": est.peak / got["peak_bytes"]}


VERSIONS = ("python", "torch", "transformers", "bitsandbytes")  # run()'s order


def markdown(res: dict) -> str:
    """``results.md`` from the record (rows in :data:`ROWS` then :data:`DIST_ROWS` order)."""
    rows = ordered(res["rows"], [*ROWS, *DIST_ROWS])
    lines = ["# rankwise plan: predicted vs measured peak memory", "",
             f"Command: `{res['command']}`", "",
             "Measured = model tensors + optimizer state + the peak of one more step above them "
             f"(meter `{res['meter']}`, {res.get('device', 'cpu')}, one torch thread). Predicted = "
             f"`rankwise plan --device {res.get('device', 'cpu')} --json`'s `peak_mb`, from the run "
             "config only (meta device).", "",
             "| row | predicted MiB | measured MiB | ratio | weights pred / meas MiB | state pred / "
             "meas MiB | step peak meas MiB | dominant (pred) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['predicted_peak_bytes'] / 2**20:.2f} | {r['peak_bytes'] / 2**20:.2f} "
                     f"| {r['ratio']:.3f} | {r['predicted_weights_bytes'] / 2**20:.2f} / "
                     f"{r['weights_bytes'] / 2**20:.2f} | {r['predicted_state_bytes'] / 2**20:.3f} / "
                     f"{r['state_bytes'] / 2**20:.3f} | {r['step_peak_bytes'] / 2**20:.2f} | "
                     f"{r['predicted']['dominant']} |")
    dist = {n: r for n, r in rows.items() if r.get("processes", 1) > 1}
    if dist:
        lines += ["", f"Rows ending `x{NPROC}`: `torchrun --standalone --nproc-per-node {NPROC}` (gloo, "
                  "`train.distributed` fsdp or ddp, `train.batch_size` the global batch); measured = the "
                  f"larger process's peak over {DIST_REPEATS} measured steps, weights and state its own "
                  f"shards; predicted = `rankwise plan --nproc {NPROC}`. Per-process peaks (MiB):"]
        for n, r in dist.items():
            per = [f"{b / 2**20:.2f}" for b in r["per_process_peak_bytes"]]
            lines.append(f"- {n}: {' / '.join(per)}")
    miss = [n for n, r in rows.items() if abs(r["ratio"] - 1) > 0.10]
    lines += ["", f"Goal: every ratio within 10 %. Rows outside: {', '.join(miss) or 'none'}.",
              f"Versions: {ordered(res['versions'], VERSIONS)}. Total time {res['wall_s']:.0f} s.", ""]
    return "\n".join(lines)


def run(out: Path, rows: list[str] | None = None, command: str | None = None,
        device: str = "cpu") -> dict:
    """Run the benchmark and write ``out/results.json`` and ``out/results.md``.

    Args:
        out: Output folder.
        rows: Row names (default: all of :data:`ROWS` and :data:`DIST_ROWS`; on ``cuda`` the
            torchrun rows are left out: they need one GPU per process).
        command: The command line recorded.
        device: ``cpu`` (the shared meter's live tensors) or ``cuda`` (``max_memory_allocated``;
            ``bench/gpu/plan.sh``).

    Returns:
        The results dict.
    """
    from transformers import logging as hf_logging

    from rankwise.errors import require
    require("bitsandbytes", "bench", "rankwise bench plan")
    hf_logging.set_verbosity_error()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    from rankwise.memory import meter_name
    res: dict[str, Any] = {"command": command or f"rankwise bench plan --out {out}", "rows": {},
                           "meter": meter_name(device), "device": device}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            names = rows or list(ROWS) + (list(DIST_ROWS) if device == "cpu" else [])
            for name in names:
                if name in ROWS:
                    res["rows"][name] = run_row(name, Path(tmp), device)
            dist_names = [n for n in names if n in DIST_ROWS]
            if dist_names:
                res["rows"].update(run_dist_rows(dist_names, Path(tmp)))
    finally:
        torch.set_num_threads(threads)
    import bitsandbytes
    import transformers
    res["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                       "transformers": transformers.__version__,
                       "bitsandbytes": bitsandbytes.__version__}
    res["wall_s"] = time.perf_counter() - t0
    write_results(Path(out), json.loads(json.dumps(res, default=str)), markdown(res))
    return res


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench plan --out DIR [--device cuda] [ROW ...]`` (``bench/gpu/plan.sh`` runs it
    on a GPU; the last ``--device`` wins). Prints the table.

    Returns:
        The exit code.
    """
    import argparse
    import sys

    from rankwise_bench.common import command_line
    ap = argparse.ArgumentParser(prog="rankwise bench plan")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("rows", nargs="*", help=f"rows of {[*ROWS, *DIST_ROWS]} (default: all)")
    args = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(args)
    r = run(a.out, a.rows or None, device=a.device, command=command_line("plan", args))
    print(markdown(r))
    return 0


if __name__ == "__main__":  # pragma: no cover - a torchrun process of run_dist_rows
    import sys
    if sys.argv[1:2] == ["--worker"]:
        dist_worker(Path(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
