"""``rankwise bench select``: targeted data selection on the demo task.

Setup: the packaged MiniLM, demo task (8 stdlib packages), target = ``TARGET_SIZE`` training
docstrings of the packages in ``TARGET`` (taken out of the pool); the pool is a seeded draw of
``POOL`` of the remaining training records; every rule of ``data.select`` picks 5 / 10 / 20 %
of the pool; the classifier head
(``method: frozen``, so the gradient features are the head's) trains on the chosen records for
``STEPS`` steps; reported: accuracy on the evaluation records of the target packages (and on all
packages), the selection's seconds, and the share of chosen records from the target packages.
Features are computed once and shared by the methods and budgets that use them (LESS and the
QCS proxy share the per-example gradients); each selection's seconds are its rule plus the time the
features it used took when first computed. One process; ``seeds`` seeds (default 1).
"""
from __future__ import annotations

import copy
import shutil
import time
from pathlib import Path

import torch

from rankwise_bench.common import DEMO_BASE, accuracy, write_results

TARGET = ("email", "http")
TARGET_SIZE = 32
BUDGETS = (0.05, 0.10, 0.20)
METHODS = ("random", "embedding", "less", "influence", "qcs-proxy")
RENAMED = {"qcs": "qcs-proxy"}   # rows recorded under a method's old name (issue 34 item 3)
STEPS = 30
POOL = 800  # training records scored (a seeded draw of the pool), to fit six minutes of one core
BATCH = 16


def _raw(seed: int, select: dict | None) -> dict:
    raw = copy.deepcopy(DEMO_BASE)
    raw["train"].update(steps=STEPS, batch_size=BATCH, seed=seed)
    raw["method"] = {"name": "frozen"}
    raw["optim"] = {"name": "adamw", "lr": 2.0e-2}
    if select:
        raw["data"]["select"] = select
    return raw


def _target_eval(session):
    from rankwise.data.demo import load_demo_records
    records = load_demo_records()[0]
    ev = session.eval_data
    keep = [i for i, r in enumerate(ev.positions.tolist()) if records[r]["package"] in TARGET]
    return ev.subset(keep)


def _select_all(seed: int, out: Path) -> dict:
    """Every method at every budget in one session (features shared through one cache; each
    selection's seconds = its rule + the features it used, timed when first computed)."""
    from rankwise.recipes.config import build_run_config
    from rankwise.commands.select.run import write_selection
    from rankwise.recipes import select as stage
    from rankwise.recipes.session import prepare
    from rankwise import registry
    from rankwise.data.select import budget_count
    cfg = build_run_config(_raw(seed, None))
    session = prepare(cfg, device="cpu")
    ids = stage.record_ids(cfg.data, session.train_data)
    given = {"target": "demo:" + ",".join(TARGET), "target_size": TARGET_SIZE, "seed": seed}
    rule = lambda name: registry.get("select-rule", name).config_cls(**given)  # noqa: E731
    pool, target = stage.target_split(session, rule("random"))
    draw = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))[:POOL].tolist()
    pool = sorted(pool[i] for i in draw)
    cache, folders = {}, {}
    for method in METHODS:
        sel_cfg = rule(method)
        for budget in BUDGETS:
            k = budget_count(budget, len(pool))
            cache["_used"] = set()
            before = dict(cache.get("_seconds", {}))
            start = time.perf_counter()
            s, chosen, _, _ = stage.score(session, sel_cfg, pool, target, k, cache)
            new = sum(v for key, v in cache.get("_seconds", {}).items() if key not in before)
            rule = time.perf_counter() - start - new
            seconds = rule + sum(cache["_seconds"].get(key, 0.0) for key in cache["_used"])
            sel = stage.Selection(method, [ids[i] for i in pool], [float(x) for x in s],
                                  sorted(pool[i] for i in chosen), seconds=seconds,
                                  info={"pool": len(pool), "target": len(target), "k": k})
            folder = out / "selections" / f"{method}-{budget}-s{seed}"
            write_selection(sel, [ids[i] for i in sel.chosen], folder)
            pkgs = [ids[j].split(".")[0] for j in sel.chosen]
            folders[(method, budget)] = {"dir": str(folder), "ids": [ids[i] for i in sel.chosen],
                                         "seconds": seconds, "k": k,
                                         "target_share": sum(p in TARGET for p in pkgs) / k}
    return folders


def run(out: Path, seeds: int = 1) -> dict:
    """Run the comparison; write ``results.json``, ``results.md`` and ``accuracy.png``."""
    from rich.console import Console
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.train import train
    from rankwise.recipes.session import prepare
    import tempfile
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(tempfile.mkdtemp(prefix="bench-select-"))  # run folders hold weights: not in out
    rows = []
    for seed in range(seeds):
        for (method, budget), sel in _select_all(seed, runs).items():
            cfg = build_run_config(_raw(seed, {"from": sel["dir"]}))
            session = prepare(cfg, device="cpu")
            train(cfg, runs / f"{method}-{budget}-s{seed}", session=session,
                  console=Console(stderr=True, quiet=True), summary=False)
            rows.append({"method": method, "budget": budget, "seed": seed,
                         **{key: v for key, v in sel.items() if key != "dir"},
                         "target_accuracy": accuracy(session.model, session, _target_eval(session)),
                         "all_accuracy": accuracy(session.model, session)})
        cfg = build_run_config(_raw(seed, None))
        session = prepare(cfg, device="cpu")
        train(cfg, runs / f"full-s{seed}", session=session, console=Console(stderr=True, quiet=True),
              summary=False)
        rows.append({"method": "full", "budget": 1.0, "seed": seed, "seconds": 0.0, "k": len(session.train_data),
                     "target_share": None, "target_accuracy": accuracy(session.model, session, _target_eval(session)),
                     "all_accuracy": accuracy(session.model, session)})
    result = {"setup": {"target": TARGET, "target_size": TARGET_SIZE, "budgets": BUDGETS, "steps": STEPS,
                        "method": "frozen (head only)", "seeds": seeds}, "rows": rows}
    shutil.rmtree(runs, ignore_errors=True)
    write_results(out, result, markdown(result))
    _plot(rows, out / "accuracy.png")
    return result


def markdown(result: dict) -> str:
    """``results.md`` from the record: the summary over seeds, then every run."""
    lines = ["| method | budget | k | target acc | all acc | target share | select s |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        share = "" if r["target_share"] is None else f"{r['target_share']:.2f}"
        lines.append(f"| {method_of(r)} | {r['budget']:.2f} | {r['k']} | {r['target_accuracy']:.3f} | "
                     f"{r['all_accuracy']:.3f} | {share} | {r['seconds']:.1f} |")
    return "\n".join(_summary(result["rows"]) + ["", "Every run:", ""] + lines) + "\n"


def method_of(row: dict) -> str:
    """A row's method under its current name (``qcs`` rows are the ``qcs-proxy``: same rule)."""
    return RENAMED.get(row["method"], row["method"])


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench select --out DIR [--seeds N]``."""
    from rankwise_bench.common import keyword_main
    return keyword_main(run, argv, "select", seeds=(int, 1))


def _mean_sd(xs: list[float]) -> str:
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
    return f"{m:.3f} ± {sd:.3f}"


def _summary(rows: list[dict]) -> list[str]:
    """Mean ± sample std over seeds of each method and budget (the table the docs quote)."""
    seeds = len({r["seed"] for r in rows})
    lines = [f"Mean ± sample std over {seeds} seed(s):", "",
             "| method | budget | target acc | all acc | target share | select s |", "|---|---|---|---|---|---|"]
    for method in (*METHODS, "full"):
        for budget in sorted({r["budget"] for r in rows if method_of(r) == method}):
            rs = [r for r in rows if method_of(r) == method and r["budget"] == budget]
            share = "" if rs[0]["target_share"] is None else _mean_sd([r["target_share"] for r in rs])
            lines.append(f"| {method} | {budget:.2f} | {_mean_sd([r['target_accuracy'] for r in rs])} | "
                         f"{_mean_sd([r['all_accuracy'] for r in rs])} | {share} | "
                         f"{sum(r['seconds'] for r in rs) / len(rs):.1f} |")
    return lines


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for method in METHODS:
        budgets = sorted({r["budget"] for r in rows if method_of(r) == method})
        means = [sum(acc := [r["target_accuracy"] for r in rows if method_of(r) == method and r["budget"] == b])
                 / len(acc) for b in budgets]  # mean over seeds
        ax.plot([b * 100 for b in budgets], means, marker="o", label=method)
    full = [r["target_accuracy"] for r in rows if r["method"] == "full"]
    if full:
        ax.axhline(sum(full) / len(full), color="0.5", ls="--", label="all data")
    ax.set_xlabel("budget (% of training records)")
    ax.set_ylabel("accuracy on target packages")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
