"""Activation offloading: peak memory of LoRA training steps with and without
``train.offload_activations``, with and without gradient checkpointing.

Rows (each a fresh model from the same seed, stepped by the engine with AdamW on the same
batches): ``plain``, ``offload``, ``ckpt``, ``ckpt+offload``. Per row: the peak one training
step adds above the weights and optimizer state (``rankwise.memory.PeakMemory``: CUDA's
``max_memory_allocated`` on a GPU), the median step time, the bytes the pack hook moved to
host memory per step, and the losses of every step; results compare each ``+offload`` row with
its row without (memory ratio, time ratio, largest loss difference).

``bench/gpu/offload.sh`` runs the ``gpu`` preset: a Llama of 8 layers x 1024 wide (intermediate
2816, vocabulary 32000, ~170 M parameters) in bf16 at sequence 2048 x batch 4, LoRA r=16 on every
linear layer, bf16 autocast. On a CPU device offloading has nothing to move to (the engine
installs no hooks); the ``tiny`` CPU preset, which the tests run, swaps in the hooks' copying
path (``copy_on_cpu``) so that the plumbing and the loss equality are still exercised.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise_bench.common import llama, write_results

ROWS = {"plain": (False, False), "offload": (False, True), "ckpt": (True, False),
        "ckpt+offload": (True, True)}  # row -> (gradient checkpointing, offloading)


@dataclass
class Sizes:
    """Everything that sets the benchmark's size.

    Attributes:
        hidden, layers, heads, intermediate, vocab: The Llama shape (full multi-head attention).
        seq: Tokens per sequence.
        batch: Sequences per optimizer step.
        warmup: Untimed steps per row first.
        steps: Timed steps per row (the last one measured for memory).
        r, alpha, lr: LoRA rank and alpha, AdamW learning rate.
        dtype: Base weights' dtype (``bfloat16`` or ``float32``).
        precision: The engine's autocast (``bf16`` or ``fp32``).
        rows: Rows to run (keys of :data:`ROWS`).
        device: ``cuda`` or ``cpu``.
        seed: Seed of the weights and the tokens.
    """

    hidden: int = 1024
    layers: int = 8
    heads: int = 16
    intermediate: int = 2816
    vocab: int = 32000
    seq: int = 2048
    batch: int = 4
    warmup: int = 2
    steps: int = 3
    r: int = 16
    alpha: float = 32.0
    lr: float = 1e-4
    dtype: str = "bfloat16"
    precision: str = "bf16"
    rows: tuple[str, ...] = tuple(ROWS)
    device: str = "cuda"
    seed: int = 0


PRESETS = {
    "gpu": Sizes(),
    "tiny": Sizes(hidden=64, layers=2, heads=4, intermediate=128, vocab=256, seq=32, batch=2,
                  warmup=1, steps=2, dtype="float32", precision="fp32", device="cpu"),
}


class _Tokens(list):
    """Random token sequences (memory does not depend on what the tokens say)."""

    pad_id = 0


def _model(s: Sizes, ckpt: bool) -> nn.Module:
    import rankwise
    model = llama(s.vocab, s.hidden, s.layers, s.heads, s.intermediate, positions=s.seq, seed=s.seed,
                  pad_token_id=0).to(getattr(torch, s.dtype)).to(s.device)
    rankwise.apply(model, "lora", r=s.r, alpha=s.alpha, targets="all-linear")
    if ckpt:
        from rankwise.recipes.model import enable_checkpointing
        enable_checkpointing(model)
    return model


def run_row(row: str, s: Sizes, data: _Tokens) -> dict[str, Any]:
    """Step one row's model and measure it."""
    from rankwise.core.quant import model_bytes
    from rankwise.engine import Engine, get_task
    from rankwise.engine.offload import OffloadActivations
    from rankwise.memory import PeakMemory, tensor_bytes
    ckpt, offload = ROWS[row]
    model = _model(s, ckpt)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=s.lr)
    engine = Engine(model, get_task("causal-lm"), opt, data, s.batch, seed=s.seed,
                    precision=s.precision, device=s.device, offload_activations=offload)
    if offload and not engine.offloader.active:  # a CPU device: run the copying path anyway
        engine.offloader = OffloadActivations(s.device, copy_on_cpu=True)
    cuda = s.device.startswith("cuda")
    losses, times = [], []
    for k in range(s.warmup + s.steps - 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(engine.train_step(k).loss)
        if cuda:
            torch.cuda.synchronize()
        if k >= s.warmup:
            times.append(time.perf_counter() - t0)
    held = model_bytes(model) + tensor_bytes(dict(opt.state))
    moved_before = engine.offloader.stats.moved_bytes if offload else 0
    with PeakMemory(s.device) as mem:
        t0 = time.perf_counter()
        losses.append(engine.train_step(s.warmup + s.steps - 1).loss)
    times.append(time.perf_counter() - t0)  # PeakMemory synchronises on CUDA
    out = {"checkpointing": ckpt, "offload": offload, "held_bytes": held,
           "step_peak_bytes": mem.peak_bytes, "peak_bytes": held + mem.peak_bytes,
           "memory_meter": mem.meter, "step_s": statistics.median(times), "step_s_all": times,
           "moved_bytes_per_step": (engine.offloader.stats.moved_bytes - moved_before) if offload else 0,
           "losses": losses}
    del engine, opt, model
    if cuda:
        torch.cuda.empty_cache()
    return out


def _compare(rows: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for without in ("plain", "ckpt"):
        with_ = "offload" if without == "plain" else "ckpt+offload"
        if without in rows and with_ in rows:
            a, b = rows[without], rows[with_]
            out[with_] = {"vs": without,
                          "step_peak_ratio": b["step_peak_bytes"] / max(a["step_peak_bytes"], 1),
                          "peak_ratio": b["peak_bytes"] / max(a["peak_bytes"], 1),
                          "step_time_ratio": b["step_s"] / a["step_s"],
                          "max_loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))}
    return out


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    s = res["sizes"]
    lines = [f"# Activation offloading: Llama {s['layers']} x {s['hidden']}, sequence {s['seq']} x "
             f"batch {s['batch']}, LoRA r={s['r']}, {s['dtype']} base, {s['precision']} ({res['device']})",
             "", f"Command: `{res['command']}`", "",
             "| row | step peak MiB | peak MiB (with weights + state) | moved to host MiB/step | "
             "step s |", "|---|---:|---:|---:|---:|"]
    for name, r in res["rows"].items():
        lines.append(f"| {name} | {r['step_peak_bytes'] / 2**20:.1f} | {r['peak_bytes'] / 2**20:.1f} | "
                     f"{r['moved_bytes_per_step'] / 2**20:.1f} | {r['step_s']:.3f} |")
    lines += ["", "| row | vs | step peak ratio | peak ratio | step time ratio | max loss diff |",
              "|---|---|---:|---:|---:|---:|"]
    for name, c in res["compare"].items():
        lines.append(f"| {name} | {c['vs']} | {c['step_peak_ratio']:.3f} | {c['peak_ratio']:.3f} | "
                     f"{c['step_time_ratio']:.2f} | {c['max_loss_diff']:.2e} |")
    lines += ["", f"Memory meter: `{res['memory_meter']}`. Step peak = the peak one training step "
              "adds above the weights and optimizer state."]
    return "\n".join(lines) + "\n"


def run(out: Path, sizes: Sizes | None = None, command: str | None = None) -> dict:
    """Run the rows and write ``out/results.json`` and ``out/results.md``.

    Args:
        out: Output folder (created if missing).
        sizes: The size (default :data:`PRESETS` ``["gpu"]``).
        command: The command line recorded in the results.

    Returns:
        The results dict.

    Raises:
        RankwiseError: Unknown rows, or CUDA asked for and absent.
    """
    from rankwise.errors import RankwiseError
    s = copy.deepcopy(sizes or PRESETS["gpu"])
    unknown = [r for r in s.rows if r not in ROWS]
    if unknown:
        raise RankwiseError(f"offload rows {unknown} are unknown; choose from {list(ROWS)}")
    if s.device.startswith("cuda") and not torch.cuda.is_available():
        raise RankwiseError("offload benchmark: device cuda asked for but no CUDA GPU is visible; "
                            "run on a GPU machine or use --preset tiny")
    from transformers import logging as hf_logging
    hf_logging.set_verbosity_error()
    g = torch.Generator().manual_seed(s.seed)
    data = _Tokens({"input_ids": torch.randint(1, s.vocab, (s.seq,), generator=g).tolist()}
                   for _ in range(s.batch * (s.warmup + s.steps)))
    t_start = time.perf_counter()
    res: dict[str, Any] = {"command": command or f"rankwise bench offload --out {out}",
                           "sizes": dataclasses.asdict(s), "device": s.device,
                           "rows": {row: run_row(row, s, data) for row in s.rows}}
    from rankwise.memory import meter_name
    res["compare"] = _compare(res["rows"])
    res["memory_meter"] = meter_name(s.device)
    res["torch"] = torch.__version__
    if s.device.startswith("cuda"):
        res["gpu"] = torch.cuda.get_device_name(s.device)
    res["wall_s"] = time.perf_counter() - t_start
    out = Path(out)
    write_results(out, res, markdown(res))
    return res


def main(argv: list[str] | None = None) -> dict:
    """``rankwise bench offload --out DIR [--preset P] [--set k=v ...]``."""
    from rankwise_bench.common import preset_main
    return preset_main(argv, name="offload", doc=__doc__, presets=PRESETS,
                       default="gpu", run=run, show=markdown)


if __name__ == "__main__":
    main()
