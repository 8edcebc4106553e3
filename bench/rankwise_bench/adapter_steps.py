"""``rankwise bench adapter-steps``: the training-step cost of every adapter method against
LoRA at the matched budgets of ``examples/compare-tuned.yaml`` (MiniLM on the demo task, 32
examples of 32 tokens per step).

Each row is prepared exactly as ``rankwise compare`` prepares it (the YAML's per-row settings),
one warm-up step is taken, then ``steps`` steps are timed by the CPU time of this process on one
torch thread (``time.process_time``), so the ratio to LoRA says what the method costs, not what
else the machine was doing. The target of issue 19: routed adapters (S'MoRE, MoE-LoRA) at most
2x LoRA's step.
"""
from __future__ import annotations

import copy
import time
from pathlib import Path

import yaml

from rankwise_bench.common import ROOT, torch_threads, write_results

CONFIG = ROOT / "examples" / "compare-tuned.yaml"
ROWS = ("lora", "moe-lora", "smore", "lope", "fvae-lora", "prompt-tuning", "pt-moe", "capt")
TARGET = {"moe-lora": 2.0, "smore": 2.0}


def step_time(raw: dict, steps: int) -> tuple[float, int]:
    """CPU seconds per training step of the run config ``raw`` (after one warm-up step) and its
    trainable-parameter count."""
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.session import prepare
    session = prepare(build_run_config(copy.deepcopy(raw)), device="cpu")
    engine = session.engine()
    engine.train_step(0)
    began = time.process_time()
    for step in range(1, steps + 1):
        engine.train_step(step)
    trainable = sum(p.numel() for p in session.model.parameters() if p.requires_grad)
    return (time.process_time() - began) / steps, trainable


def run(out: Path, steps: int = 10, rows: tuple[str, ...] = ROWS, config: Path = CONFIG) -> dict:
    """Time every row and write ``results.json`` and ``results.md``.

    Args:
        out: Output folder.
        steps: Timed steps per row.
        rows: Rows of the comparison (``lora`` is the base and always included).
        config: The comparison YAML whose ``compare:`` section sets each row.

    Returns:
        ``{"rows": {row: {"step_s", "ratio", "trainable"}}, ...}``.
    """
    from rankwise.commands.compare.run import row_config
    raw = yaml.safe_load(Path(config).read_text())
    extras = raw.pop("compare", None) or {}
    raw["train"]["steps"] = steps + 1
    result: dict[str, dict] = {}
    with torch_threads(1):
        for row in dict.fromkeys(("lora", *rows)):
            over = {k: v for k, v in (extras.get(row) or {}).items() if k != "lr_grid"}
            secs, trainable = step_time(row_config(copy.deepcopy(raw), row, over), steps)
            result[row] = {"step_s": round(secs, 4), "trainable": trainable}
    base = result["lora"]["step_s"]
    for r in result.values():
        r["ratio"] = round(r["step_s"] / base, 3)
    payload = {"steps": steps, "threads": 1, "config": Path(config).name, "rows": result}
    write_results(Path(out), payload, markdown(payload))
    return payload


def markdown(payload: dict) -> str:
    """``results.md`` from the record: each row's step time and its ratio to LoRA's."""
    lines = ["# adapter-steps", "",
             f"CPU time per training step on one torch thread ({payload['steps']} steps after one warm-up), "
             f"MiniLM on the demo task at the budgets of `{payload['config']}`; target: routed "
             "adapters <= 2.0x LoRA.", "",
             "| row | trainable | s/step (CPU) | / LoRA | target |", "|---|---:|---:|---:|---|"]
    for row, r in payload["rows"].items():
        target = TARGET.get(row)
        verdict = "" if target is None else ("held" if r["ratio"] <= target else "did not hold") + f" (<= {target}x)"
        lines.append(f"| {row} | {r['trainable']:,} | {r['step_s']:.3f} | {r['ratio']:.2f} | {verdict} |")
    return "\n".join(lines) + "\n"


__all__ = ["markdown", "run", "step_time", "ROWS", "TARGET"]
