"""``rankwise bench federated-demo``: every strategy on the naturally partitioned demo task.

Same model (packaged MiniLM), LoRA (r=8, all linear layers), clients (4 organisations owning
two stdlib packages each), rounds and local steps for every strategy; YOCO runs its one round
with the same total local steps. Writes ``results.md``, ``results.json`` and
``accuracy_vs_bytes.png`` plus one run folder per strategy under ``runs/``.
"""
from __future__ import annotations

import copy
import json
import platform
from pathlib import Path

from rankwise.federated.run import run_federated, write_results

STRATEGIES = ("fedit", "ffa-lora", "rolora", "fedlease", "yoco", "leff")

BASE = {
    "model": {"path": "demo"},
    "data": {"source": "demo", "max_length": 32, "eval_fraction": 0.2},
    "method": {"name": "lora", "r": 8, "alpha": 16, "targets": "all-linear"},
    "optim": {"name": "adamw", "lr": 2e-3},
    "train": {"batch_size": 16, "eval_batch_size": 128, "seed": 0},
    "federated": {"clients": 4, "rounds": 4, "local_steps": 6, "partition": "natural",
                  "min_clients": 2, "client_cpus": 1},
}


def run(out: Path, strategies: tuple[str, ...] = STRATEGIES, sets: list[str] | None = None) -> dict:
    """Run the comparison and write the table and plot into ``out``.

    Args:
        out: Results folder (``bench/results/federated-demo``).
        strategies: Which strategies to run.
        sets: Extra ``--set`` overrides applied to every run.

    Returns:
        The rows of ``results.json``.
    """
    out = Path(out)
    runs = {}
    for name in strategies:
        folder = out / "runs" / name
        if not (folder / "metrics.json").exists():
            base = copy.deepcopy(BASE)
            base["federated"]["strategy"] = name
            run_federated(None, list(sets or []), folder, base=base)
        runs[name] = folder
    rows = write_results(runs, out, title="demo task, natural partition, 4 clients")
    meta = {"python": platform.python_version(), "config": BASE, "overrides": list(sets or []),
            "strategies": list(strategies)}
    (out / "setup.json").write_text(json.dumps(meta, indent=2) + "\n")
    return rows
