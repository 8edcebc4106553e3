"""Where LoPE's router sends noise: the poisoning expert's gate in the LoPE runs of ``rankwise
compare`` folders, and LoPE against LoRA per label-noise level (``examples/lope-noisy.yaml``).

    PYTHONPATH=bench python -m rankwise_bench.poison_gate bench/results/lope-noisy-0 \\
        bench/results/lope-noisy-20 bench/results/lope-noisy-40

Not a benchmark (it trains nothing): it reads each LoPE run's ``router_stats.json``, whose
``poison_gate`` holds per adapted layer the router's mean weight ``g_p`` on the poisoning expert
over real tokens, apart for ``noisy`` (stage-1 forwards on generated noisy data), ``task``
(stage-2 training forwards) and ``eval`` (the final evaluation, before the mask drops it).
LoPE's reading wants ``noisy`` well above ``task`` and ``eval``. Each folder gets
``poison_gate.json`` and ``poison_gate.md`` (one row per LoPE run: the mean of ``g_p`` over the
layers per kind, its range, and the share of layers where ``noisy`` exceeds ``task``); the
cross-level table (accuracy mean ± std of every row, LoPE minus LoRA) is printed.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

KINDS = ("noisy", "task", "eval")


def gates(router_stats: dict) -> dict[str, list[float]]:
    """``{kind: [g_p of each adapted layer]}`` of one ``router_stats.json`` (layers without a
    poisoning expert, or a kind no forward reached, are left out)."""
    out: dict[str, list[float]] = {k: [] for k in KINDS}
    for routers in router_stats.get("layers", {}).values():
        for stats in routers.values():
            for kind, g in (stats.get("poison_gate") or {}).items():
                if kind in out and g.get("tokens", 0) > 0:
                    out[kind].append(float(g["mean"]))
    return out


def run_summary(run_dir: Path) -> dict:
    """One LoPE run: per kind the mean, min and max of ``g_p`` over its layers, the share of
    layers with ``noisy > task``, and the run's evaluation accuracy.

    Args:
        run_dir: A run folder holding ``router_stats.json`` and ``metrics.json``.

    Returns:
        ``{"run", "layers", "eval_accuracy", "noisy_above_task", KIND: {"mean", "min", "max"}}``.
    """
    g = gates(json.loads((run_dir / "router_stats.json").read_text()))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    pairs = list(zip(g["noisy"], g["task"]))
    out = {"run": run_dir.name, "layers": len(pairs), "eval_accuracy": metrics.get("eval_accuracy"),
           "noisy_above_task": sum(n > t for n, t in pairs) / len(pairs) if pairs else None}
    for kind, vals in g.items():
        out[kind] = ({"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}
                     if vals else None)
    return out


def folder_markdown(folder: Path, runs: list[dict]) -> str:
    """The ``poison_gate.md`` of one comparison folder."""
    def cell(s: dict | None) -> str:
        return "-" if s is None else f"{s['mean']:.3f} ({s['min']:.2f}-{s['max']:.2f})"
    lines = [f"## LoPE's poisoning-expert gate in {folder.name}", "",
             "Mean router weight g_p on the poisoning expert over the adapted layers (range over layers); "
             "1/(E+1) = 0.333 is a uniform router over E + 1 = 3 experts. Accuracy: the run's own "
             "evaluation (lr* runs: the clean validation slice; seed runs: the clean evaluation split).", "",
             "| run | accuracy (%) | noisy (stage 1) | task (stage 2) | eval | layers noisy > task |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        acc = "-" if r["eval_accuracy"] is None else f"{100 * r['eval_accuracy']:.1f}"
        share = "-" if r["noisy_above_task"] is None else f"{r['noisy_above_task']:.0%} of {r['layers']}"
        lines.append(f"| {r['run']} | {acc} | {cell(r['noisy'])} | {cell(r['task'])} | {cell(r['eval'])} | {share} |")
    return "\n".join(lines) + "\n"


def write_folder(folder: Path, row: str = "lope") -> list[dict]:
    """Summarise every run of ``folder/row`` with a ``router_stats.json``; write
    ``poison_gate.json`` and ``poison_gate.md`` into ``folder``.

    Returns:
        The run summaries, sweep points (``lr*``) first, then the seeds.
    """
    dirs = sorted((p.parent for p in (folder / row).glob("*/router_stats.json")),
                  key=lambda p: (not p.name.startswith("lr"), p.name))
    runs = [run_summary(d) for d in dirs]
    (folder / "poison_gate.json").write_text(json.dumps(runs, indent=2) + "\n")
    (folder / "poison_gate.md").write_text(folder_markdown(folder, runs))
    return runs


def levels_markdown(folders: list[Path]) -> str:
    """Accuracy mean ± std per row and level, and LoPE minus LoRA, from each ``results.json``."""
    lines = ["| label noise | LoRA lr | LoRA (%) | LoPE lr | LoPE (%) | LoPE - LoRA (points) |",
             "|---|---:|---:|---:|---:|---:|"]
    for folder in folders:
        res = json.loads((folder / "results.json").read_text())
        noise = next((s.split("=", 1)[1] for s in res.get("sets", []) if s.startswith("data.label_noise=")), "?")
        rows = res["rows"]
        cells, means = [], {}
        for name in ("lora", "lope"):
            s = rows[name]
            means[name] = 100 * s["mean"]["eval_accuracy"]
            cells += [f"{s['lr']:.3g}", f"{means[name]:.1f} ± {100 * s['std']['eval_accuracy']:.1f}"]
        lines.append(f"| {noise} | " + " | ".join(cells) + f" | {means['lope'] - means['lora']:+.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write each folder's ``poison_gate`` files and print them with the cross-level table."""
    folders = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    for folder in folders:
        write_folder(folder)
        print((folder / "poison_gate.md").read_text())
    done = [f for f in folders if (f / "results.json").exists()]
    if done:
        print(levels_markdown(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
