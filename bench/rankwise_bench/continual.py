"""``rankwise bench continual``: HRM-PET against plain key matching, sequential fine-tuning and
joint training on the demo task split into 4 tasks of 2 packages, 3 task orders.

Quality only (accuracy, forgetting; no time claim). Each (row, order) is one piece
(``pieces/<row>-<order>.json``, committed), written when it finishes and skipped when present, so
an interrupted run resumes. Rows:

* ``hrm-pet``: per-task LoRA trained with CTIRD; reported as released (the trained task-identity
  classifier, ``tii``, then the hybrid re-matching with the GEN gate at ``tau = -10``:
  ``tii:hrm``), with ``tau`` tuned on the validation split (``tii:hrm-tuned``), and, on the
  same modules, plain matching, direct re-matching only, key matching and the oracle module;
* ``key-match``: per-task LoRA without CTIRD, key matching (L2P/CODA-style, ``keys:match``); the
  same modules are also scored with the task-identity matcher and re-matching, so re-matching
  is compared without CTIRD as well;
* ``sequential``: one LoRA trained task after task;
* ``joint``: one LoRA trained on all tasks (order-independent: run once).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

from rankwise.core import atomic
from rankwise_bench.common import write_results

ORDERS = ((0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1))
ROWS = ("hrm-pet", "key-match", "sequential", "joint")
# (row, rule) pairs reported; the first rule of a per-task row is its own inference
REPORT = (("hrm-pet", "tii:hrm"), ("hrm-pet", "tii:hrm-tuned"), ("hrm-pet", "tii:direct"),
          ("hrm-pet", "tii:match"), ("hrm-pet", "keys:hrm-tuned"), ("hrm-pet", "keys:direct"),
          ("hrm-pet", "keys:match"), ("hrm-pet", "oracle"),
          ("key-match", "keys:match"), ("key-match", "tii:match"), ("key-match", "tii:hrm-tuned"),
          ("key-match", "keys:hrm-tuned"), ("key-match", "oracle"),
          ("sequential", "single"), ("joint", "single"))


def _cfg():
    from rankwise.commands.continual.run import ContinualConfig
    return ContinualConfig(eval_per_class=15)


def run(out: Path) -> dict:
    """Run the missing pieces (every row's order 0 first, so a cut-short run still compares all
    rows), then :func:`report`."""
    from rankwise.data.demo import PACKAGES
    from rankwise.commands.continual.run import DEMO_TASKS, parse_tasks, run_continual
    import torch
    torch.set_num_threads(1)
    out = Path(out)
    (out / "pieces").mkdir(parents=True, exist_ok=True)
    base = parse_tasks(DEMO_TASKS, PACKAGES)
    for oi, order in enumerate(ORDERS):
        for row in ROWS:
            piece = out / "pieces" / f"{row}-{oi}.json"
            if (row == "joint" and oi > 0) or piece.exists():
                continue
            rec = run_continual(replace(_cfg(), method=row), [base[i] for i in order])
            rec["order"] = list(order)
            atomic.write_json(piece, rec)
    return report(out)


def report(out: Path) -> dict:
    """``results.json``, ``results.md`` and ``accuracy.png`` from the pieces present."""
    from rankwise.data.demo import PACKAGES, python_version
    from rankwise.commands.continual.run import DEMO_TASKS, parse_tasks
    import torch
    out = Path(out)
    base = parse_tasks(DEMO_TASKS, PACKAGES)
    records = {}
    for oi in range(len(ORDERS)):
        for row in ROWS:
            piece = out / "pieces" / f"{row}-{oi}.json"
            if piece.exists():
                records[(row, oi)] = json.loads(piece.read_text())
    table = {}
    for row, rule in REPORT:
        recs = [r for (rw, _), r in records.items() if rw == row]
        if not recs:
            continue
        acc = [r["rules"][rule]["average_accuracy"] for r in recs]
        fg = [r["rules"][rule]["forgetting"] for r in recs if r["rules"][rule]["forgetting"] is not None]
        table[f"{row} [{rule}]"] = {
            "average_accuracy": acc, "forgetting": fg, "orders": [r.get("order") for r in recs],
            "acc_mean": statistics.fmean(acc), "acc_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "forget_mean": statistics.fmean(fg) if fg else None,
            "curve": [statistics.fmean(statistics.fmean(r["rules"][rule]["matrix"][t]) for r in recs)
                      for t in range(len(recs[0]["rules"][rule]["matrix"]))]}
    rematch = {row: [r["rematch"] for (rw, _), r in records.items() if rw == row] for row in ("hrm-pet", "key-match")}
    config = next(iter(records.values()))["config"] if records else None
    result = {"python": python_version(), "torch": torch.__version__, "config": config,
              "tasks": base, "orders": [list(o) for o in ORDERS], "pieces": sorted(f"{r}-{o}" for r, o in records),
              "rows": table, "rematch": rematch}
    write_results(out, result, markdown(result))
    if table:
        _plot(table, out / "accuracy.png")
    return result


def markdown(result: dict) -> str:
    """``results.md`` from the record (the summary of the pieces that :func:`report` read)."""
    cfg, rematch = result["config"] or {}, result["rematch"]
    names = [f"{row} [{rule}]" for row, rule in REPORT]   # REPORT's order (a record's keys may be sorted)
    table = {n: result["rows"][n] for n in names if n in result["rows"]}
    lines = ["# rankwise bench continual (HRM-PET)", "",
             f"Demo task (MiniLM, 8 stdlib packages) as 4 tasks of 2 classes, class-incremental; "
             f"{cfg.get('steps_per_task')} steps x {cfg.get('batch_size')} per task, "
             f"{cfg.get('eval_per_class')} eval examples per class; task orders {[list(o) for o in ORDERS]} "
             f"(joint: one run). Python {result['python']}, torch {result['torch']}. Quality only. "
             f"Pieces present: {len(result['pieces'])} of {len(ORDERS) * (len(ROWS) - 1) + 1}.", "",
             "| row [inference rule] | orders | average accuracy % (mean ± std over orders) | forgetting % |",
             "|---|---:|---:|---:|"]
    for name, t in table.items():
        f = "-" if t["forget_mean"] is None else f"{100 * t['forget_mean']:.1f}"
        lines.append(f"| {name} | {len(t['average_accuracy'])} | {100 * t['acc_mean']:.1f} ± {100 * t['acc_std']:.1f} | {f} |")
    lines += ["", "Per-order average accuracy (%):", ""]
    for name, t in table.items():
        lines.append(f"- {name}: " + ", ".join(f"{100 * a:.1f}" for a in t["average_accuracy"]))
    lines += ["", "Re-matching counts per evaluation point, per initial matcher (examples switched by the "
              "direct rule; examples whose gate score is below tau = "
              f"{cfg.get('tau')} ({cfg.get('gate')}) and below the validation-tuned tau; the gate "
              "scores' range; the matcher's task accuracy):", ""]
    for row in ("hrm-pet", "key-match"):
        for r in rematch.get(row, []):
            for m, c in (r or {}).items():
                lines.append(f"- {row} [{m}]: switched {c['switched']}, unsure {c['unsure']}, "
                             f"unsure at tuned tau {c['unsure_tuned']} (tau {[round(v, 3) for v in c['tau_tuned']]}), "
                             f"scores {round(min(c['score_min']), 2)}..{round(max(c['score_max']), 2)}, "
                             f"task accuracy {[round(a, 3) for a in c['match_task_accuracy']]}")
    return "\n".join(lines) + "\n"


def _plot(table: dict, path: Path) -> None:
    """Average accuracy over the tasks seen so far, after each task (mean over orders); the
    joint upper bound as one point after the last task."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, t in table.items():
        if name.startswith("joint"):
            ax.plot([len(ORDERS[0])], t["curve"], "k*", markersize=10, label=name)
        elif not name.endswith("[direct]"):
            ax.plot(range(1, len(t["curve"]) + 1), t["curve"], marker="o",
                    linestyle="--" if "oracle" in name else "-", label=name)
    ax.set(xlabel="tasks learned", ylabel="average accuracy (seen tasks)", ylim=(0, 1), xticks=[1, 2, 3, 4],
           title="continual demo task (class-incremental), mean over 3 task orders")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
