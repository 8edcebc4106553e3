"""``rankwise bench federated-demo``: every strategy on ``examples/federated-demo.yaml``.

Same model (packaged MiniLM), LoRA (r=8, all linear layers), clients (4, a Dirichlet partition
of the 8 stdlib packages), rounds and local steps for every strategy, all from the example;
YOCO runs its one round with the same total local steps. ``sets`` override every run (e.g.
``federated.partition=natural`` for the label-owning organisations). Writes ``results.md``,
``results.json`` and ``accuracy_vs_bytes.png`` plus one run folder per strategy under ``runs/``.
"""
from __future__ import annotations

import json
import platform
from pathlib import Path

import yaml

from rankwise.federated.run import run_federated, write_results
from rankwise_bench.common import ROOT

CONFIG = ROOT / "examples" / "federated-demo.yaml"
STRATEGIES = ("fedit", "ffa-lora", "rolora", "fedlease", "yoco", "leff")


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
            run_federated(CONFIG, [*(sets or []), f"federated.strategy={name}"], folder)
        runs[name] = folder
    fed = yaml.safe_load((runs[strategies[0]] / "config.yaml").read_text())["federated"]  # resolved
    skew = f"Dirichlet alpha={fed['alpha']}" if fed["partition"] == "dirichlet" else fed["partition"]
    rows = write_results(runs, out, title=f"demo task, {skew} partition, {fed['clients']} clients")
    meta = {"python": platform.python_version(), "config": yaml.safe_load(CONFIG.read_text()),
            "overrides": list(sets or []), "strategies": list(strategies)}
    (out / "setup.json").write_text(json.dumps(meta, indent=2) + "\n")
    return rows
