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
``prepare`` on the demo data).
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


def _write_model(folder: Path, shape: dict, seed: int = 0) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                      intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                      num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
                      max_position_embeddings=max(512, shape["seq"]), bos_token_id=0,
                      eos_token_id=0, pad_token_id=0, tie_word_embeddings=False, use_cache=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    from rankwise.recipes.model import load_tokenizer
    load_tokenizer("tiny-llama").save_pretrained(folder)  # load_model wants one beside the weights


def run_config(folder: Path, row: dict, shape: dict) -> dict:
    """The raw run config of a row (what a user's YAML would hold)."""
    return {"model": {"path": str(folder), "task": "causal-lm", "dtype": row.get("dtype", "float32"),
                      "quantize": row.get("quantize")},
            "data": {"max_length": shape["seq"]},
            "method": row.get("method", LORA),
            "optim": row.get("optim", {"name": "adamw", "lr": 1e-3}),
            "train": {"batch_size": shape["batch"], "grad_accum": row.get("accum", 1),
                      "precision": row.get("precision", "fp32"),
                      "gradient_checkpointing": row.get("ckpt", False), "grad_clip": 0,
                      **({"loss_chunk_tokens": row["chunk"]} if "chunk" in row else {})}}


BERT = {"model": {"path": "tiny-bert", "task": "classification"},
        "data": {"source": "demo", "max_length": 32, "limit": 256},
        "method": {"name": "lora", "r": 4, "targets": ["query", "value"]},
        "optim": {"name": "adamw", "lr": 5e-3}, "train": {"batch_size": 16, "progress": False}}


def measure_prepared(cfg, steps: int = 2) -> dict:
    """A BERT-style row: built by ``prepare`` itself (demo data, padded to the batch's
    longest text). Short texts make the batch padded, so the attention gets a mask; on CPU
    that runs SDPA's math path, which saves the ``(B, heads, T, T)`` probabilities plan does
    not count (it counts the fused kernels): the row shows that gap."""
    from rankwise.core.quant import model_bytes
    from rankwise.memory import PeakMemory, tensor_bytes
    from rankwise.recipes.train import prepare
    session = prepare(cfg, device="cpu")
    engine = session.engine()
    for k in range(steps):
        engine.train_step(k)
    weights = model_bytes(session.model)
    state = tensor_bytes(dict(session.optimizer.state))
    width = session.batch(steps)["input_ids"].shape[1]
    with PeakMemory("cpu") as mem:
        engine.train_step(steps)
    return {"weights_bytes": weights, "state_bytes": state, "step_peak_bytes": mem.peak_bytes,
            "peak_bytes": weights + state + mem.peak_bytes, "meter": mem.meter, "batch_width": width}


def measure(cfg, shape: dict, steps: int = 2) -> dict:
    """Build the run as ``prepare`` does and measure one step after ``steps`` warm-up steps."""
    from rankwise import registry
    from rankwise.benchmarks.lowrank_pretrain import ByteWindows, load_corpus
    from rankwise.core.quant import model_bytes
    from rankwise.engine import Engine, get_task
    from rankwise.memory import PeakMemory, tensor_bytes
    from rankwise.recipes.model import enable_checkpointing, load_model
    task = get_task("causal-lm")
    m = cfg.model
    model, _ = load_model(m.path, task, dtype=m.dtype, quantize=m.quantize,
                          double_quant=m.double_quant, device="cpu")
    torch.manual_seed(0)
    registry.get("method", cfg.method.name).apply(model, cfg.method, "default")
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    if cfg.train.gradient_checkpointing:
        enable_checkpointing(model)
    opt = registry.get("optimizer", cfg.optim.name).builder(model, cfg.optim)
    train, _, _ = load_corpus()
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(train) - shape["seq"], (shape["batch"] * (steps + 1),), generator=g)
    data = ByteWindows(train, starts, shape["seq"])
    task.loss_chunk_tokens = cfg.train.loss_chunk_for(model.config.vocab_size)  # as rankwise train
    engine = Engine(model, task, opt, data, cfg.train.batch_size, seed=0,
                    grad_accum=cfg.train.grad_accum, precision=cfg.train.precision, device="cpu",
                    per_layer=getattr(cfg.optim, "per_layer", False))
    for k in range(steps):
        engine.train_step(k)
    weights = model_bytes(model)
    state = tensor_bytes(dict(opt.state))
    with PeakMemory("cpu") as mem:
        engine.train_step(steps)
    return {"weights_bytes": weights, "state_bytes": state, "step_peak_bytes": mem.peak_bytes,
            "peak_bytes": weights + state + mem.peak_bytes, "meter": mem.meter}


def run_row(name: str, tmp: Path) -> dict:
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
    est = Planner(cfg, switches, "cpu", padded=bool(row.get("bert"))).estimate()
    got = measure_prepared(cfg) if row.get("bert") else measure(cfg, shape)
    return {"config": raw if row.get("bert") else run_config(Path("MODEL"), row, shape),
            "shape": None if row.get("bert") else shape,
            "predicted": est.to_json(), "predicted_peak_bytes": est.peak,
            "predicted_weights_bytes": est.weights + est.trainable,
            "predicted_state_bytes": est.optimizer_state, **got,
            "ratio": est.peak / got["peak_bytes"]}


def _markdown(res: dict) -> str:
    lines = ["# rankwise plan: predicted vs measured peak memory", "",
             f"Command: `{res['command']}`", "",
             "Measured = model tensors + optimizer state + the peak of one more step above them "
             f"(meter `{res['meter']}`, CPU, one torch thread). Predicted = `rankwise plan "
             "--device cpu --json`'s `peak_mb`, from the run config only (meta device).", "",
             "| row | predicted MiB | measured MiB | ratio | weights pred / meas MiB | state pred / "
             "meas MiB | step peak meas MiB | dominant (pred) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in res["rows"].items():
        lines.append(f"| {name} | {r['predicted_peak_bytes'] / 2**20:.2f} | {r['peak_bytes'] / 2**20:.2f} "
                     f"| {r['ratio']:.3f} | {r['predicted_weights_bytes'] / 2**20:.2f} / "
                     f"{r['weights_bytes'] / 2**20:.2f} | {r['predicted_state_bytes'] / 2**20:.3f} / "
                     f"{r['state_bytes'] / 2**20:.3f} | {r['step_peak_bytes'] / 2**20:.2f} | "
                     f"{r['predicted']['dominant']} |")
    miss = [n for n, r in res["rows"].items() if abs(r["ratio"] - 1) > 0.10]
    lines += ["", f"Goal: every ratio within 10 %. Rows outside: {', '.join(miss) or 'none'}.",
              f"Versions: {res['versions']}. Total time {res['wall_s']:.0f} s.", ""]
    return "\n".join(lines)


def run(out: Path, rows: list[str] | None = None, command: str | None = None) -> dict:
    """Run the benchmark and write ``out/results.json`` and ``out/results.md``.

    Args:
        out: Output folder.
        rows: Row names (default: all of :data:`ROWS`).
        command: The command line recorded.

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
    res: dict[str, Any] = {"command": command or f"rankwise bench plan --out {out}", "rows": {},
                           "meter": "cpu_live_tensors"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in rows or list(ROWS):
                res["rows"][name] = run_row(name, Path(tmp))
    finally:
        torch.set_num_threads(threads)
    import bitsandbytes
    import transformers
    res["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                       "transformers": transformers.__version__,
                       "bitsandbytes": bitsandbytes.__version__}
    res["wall_s"] = time.perf_counter() - t0
    out = Path(out)
    atomic.write_json(out / "results.json", json.loads(json.dumps(res, default=str)))
    atomic.write_bytes(out / "results.md", _markdown(res).encode())
    return res


if __name__ == "__main__":  # pragma: no cover
    import sys
    names = sys.argv[2:] or None
    r = run(Path(sys.argv[1]), names)
    print(_markdown(r))
