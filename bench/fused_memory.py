"""What one training step of the fused LoRA path keeps, and its peak memory against the plain
path and PEFT (``docs/fused-lora.md``, issue 39 item 4), at preset ``cpu-fused`` size.

1. **Saved tensors by module**: one step of each side under
   :class:`torch.autograd.graph.saved_tensors_hooks`; every tensor an autograd node saves is
   attributed to the innermost module running when it was saved (forward hooks; a block's
   ``mlp.down_proj`` and ``mlp.act_fn`` are not hooked - the gated MLP node of the fused path
   runs only on unhooked ones - so what the MLP saves around them is ``mlp``), counted once
   per storage (a tensor saved by several nodes, or a view, is one entry), parameters apart (no
   activation memory); what is saved inside the backward (a recompute's transients) is left
   out. Block modules are summed over the blocks (``block.*``). Under
   non-reentrant checkpointing the blocks' own saves are the checkpoint's (recomputed in the
   backward), so the hooks see only what stays saved across blocks.
2. **Peak memory** of one step after one warm-up step (the benchmark's definition: model and
   optimizer bytes plus :class:`rankwise.memory.PeakMemory`'s step peak; deterministic), and the
   two steps' losses, per row and side.

Run: ``flock /tmp/rankwise-cpu.lock env OMP_NUM_THREADS=1 PYTHONPATH=src:bench python
bench/fused_memory.py OUT_DIR [row ...]`` (rows: keys of ``llm_finetune.ROWS``; default all);
writes ``OUT_DIR/memory.json`` and ``OUT_DIR/memory.md``.
"""
from __future__ import annotations

import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from rankwise_bench import llm_finetune as lf


def _hooks(model: torch.nn.Module, stack: list[str]) -> list:
    """Forward pre/post hooks that keep ``stack`` = the running module paths."""
    handles = []

    def pop(*_args) -> None:
        stack.pop()
    for path, m in model.named_modules():
        if re.search(r"(down_proj|act_fn)($|\.)", path):  # the gated MLP node refuses hooked ones
            continue
        handles.append(m.register_forward_pre_hook(lambda _m, _a, p=path: stack.append(p)))
        handles.append(m.register_forward_hook(pop))
    return handles


def _kind(path: str) -> str:
    """``...layers.3.mlp.gate_proj.lora_A.default`` -> ``block.mlp.gate_proj``."""
    path = re.sub(r"^(base_model\.model\.)?", "", path)
    path = re.sub(r"\.(lora_[AB]|base_layer|lora_dropout)(\..*)?$", "", path)
    m = re.match(r".*layers\.\d+\.(.*)$", path)
    return "block." + m.group(1) if m else (path or "(model)")


def saved_by_module(side, k: int) -> dict[str, dict]:
    """One step of ``side`` (an ``llm_finetune._Side``); ``{module kind: {"bytes", "tensors",
    "shapes"}}`` of the activations its autograd nodes saved (parameters under ``(parameters)``)."""
    params = {p.untyped_storage().data_ptr() for p in side.model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in side.model.buffers()}
    stack: list[str] = []
    seen: set[int] = set()
    out: dict[str, dict] = defaultdict(lambda: {"bytes": 0, "tensors": 0, "shapes": defaultdict(int)})

    def pack(t: torch.Tensor):
        if torch._C._current_graph_task_id() != -1:  # saved inside the backward (a recompute's
            return t                                  # transient), not kept by the step
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            kind = "(parameters)" if ptr in params else _kind(stack[-1] if stack else "")
            row = out[kind]
            row["bytes"] += t.untyped_storage().nbytes()
            row["tensors"] += 1
            row["shapes"][f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"] += 1
        return t

    handles = _hooks(side.model, stack)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            side.engine.train_step(k)
    finally:
        for h in handles:
            h.remove()
    return {k: {**v, "shapes": dict(v["shapes"])} for k, v in sorted(out.items())}


def measure_row(folder: Path, row: str, s, data) -> dict:
    """Peak memory, losses and the saved-tensor breakdown of the plain, fused and PEFT sides."""
    ours, theirs, _ = lf.build_pair(folder, row, s)
    precision = lf.ROWS[row][2]
    sides = {"plain": lf._Side(ours, data, s, precision), "peft": lf._Side(theirs, data, s, precision),
             "fused": lf._Side(lf.build_ours(folder, row, s, fused=True)[0], data, s, precision)}
    out = {}
    for name, side in sides.items():
        side.step(0, timed=False)
        held, peak, _ = side.peak_bytes(1)
        saved = saved_by_module(side, 2)
        out[name] = {"peak_bytes": held + peak, "held_bytes": held, "step_peak_bytes": peak,
                     "losses": side.losses + [side.engine.train_step(3).loss], "saved": saved}
    for name in ("plain", "fused"):
        out[name + "_vs_peft_memory"] = out[name]["peak_bytes"] / out["peft"]["peak_bytes"]
    out["fused_vs_plain_max_loss_diff"] = max(
        abs(a - b) for a, b in zip(out["fused"]["losses"], out["plain"]["losses"]))
    return out


def markdown(res: dict) -> str:
    mib = 2.0 ** 20
    lines = ["# Fused LoRA path: saved tensors and peak memory, preset cpu-fused", "",
             f"Command: `{res['command']}`", "",
             "| row | peak MiB fused / plain / PEFT | fused / PEFT | plain / PEFT | max loss diff fused vs plain |",
             "|---|---:|---:|---:|---:|"]
    for row, r in res["rows"].items():
        lines.append(f"| {row} | {r['fused']['peak_bytes'] / mib:.1f} / {r['plain']['peak_bytes'] / mib:.1f}"
                     f" / {r['peft']['peak_bytes'] / mib:.1f} | {r['fused_vs_peft_memory']:.3f} | "
                     f"{r['plain_vs_peft_memory']:.3f} | {r['fused_vs_plain_max_loss_diff']:.2e} |")
    for row, r in res["rows"].items():
        lines += ["", f"## {row}: saved activations (MiB, all blocks) by module", "",
                  "| module | fused | plain | PEFT | fused tensors |", "|---|---:|---:|---:|---|"]
        kinds = sorted({k for side in ("fused", "plain", "peft") for k in r[side]["saved"]})
        for kind in kinds:
            cells = [r[side]["saved"].get(kind, {"bytes": 0})["bytes"] / mib for side in ("fused", "plain", "peft")]
            shapes = ", ".join(f"{n}x {s}" for s, n in r["fused"]["saved"].get(kind, {"shapes": {}})["shapes"].items())
            lines.append(f"| {kind} | {cells[0]:.2f} | {cells[1]:.2f} | {cells[2]:.2f} | {shapes} |")
        tot = [sum(v["bytes"] for k, v in r[side]["saved"].items() if k != "(parameters)") / mib
               for side in ("fused", "plain", "peft")]
        lines.append(f"| **total (no parameters)** | {tot[0]:.2f} | {tot[1]:.2f} | {tot[2]:.2f} | |")
    return "\n".join(lines) + "\n"


def main(out: Path, rows: list[str]) -> None:
    s = lf.PRESETS["cpu-fused"]
    torch.set_num_threads(1)
    from transformers import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    data, _, _ = lf._windows(s)
    res = {"command": "PYTHONPATH=src:bench python bench/fused_memory.py " + " ".join([str(out), *rows]),
           "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        lf.build_base(s, Path(tmp))
        for row in rows:
            res["rows"][row] = measure_row(Path(tmp), row, s, data)
            r = res["rows"][row]
            print(row, f"fused/peft {r['fused_vs_peft_memory']:.3f} plain/peft {r['plain_vs_peft_memory']:.3f}"
                  f" loss diff {r['fused_vs_plain_max_loss_diff']:.2e}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(res, indent=1))
    (out / "memory.md").write_text(markdown(res))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or list(lf.ROWS))
