"""``rankwise compare``: several methods on one task, the same budget, several seeds.

A *row* is what a user names on the command line: a registered method (``lora``, ``gora``,
``full``), ``METHOD+OPTIMIZER`` (``gora+altlora``, ``full+galore``), or an optimizer alone
(``altlora``: the base config's method with that optimizer). Rows are parsed from the registry,
so a new method or optimizer is a row without editing this file; every setting a row does not
override comes from the method's and optimizer's own config dataclasses. Benchmark-specific
settings (a full fine-tuning learning rate, GaLore's rank for that model) belong in the
comparison's YAML under ``compare: {row: {section: {key: value}}}``.

Named variants: a ``compare:`` entry with a ``row:`` key is a row of its own name that runs
that METHOD[+OPTIMIZER] with the entry's overrides, e.g. ``rslora: {row: lora, method:
{use_rslora: true}}`` or ``pissa: {row: lora, method: {init: pissa}}``; it is named on the command
line like any row (``--methods lora,rslora,pissa``).

Same budget: the base config's shared method settings (``r``, ``alpha``, ``targets``,
``exclude``, ``dropout``, ``modules_to_save``) are carried into every row whose method
config has those fields, so LoRA at rank r, GoRA with r0 = r (budget sum (m+n)·r) and AltLoRA
over the same LoRA train the same number of adapter weights (up to GoRA's rounding).

Output folder: ``<row>/seed<k>/`` (ordinary run folders), ``results.json``, ``results.md``
and ``results.png``. Finished runs of the same resolved config are reused from their small
files and interrupted ones continued (:mod:`rankwise.recipes.runs`), so an interrupted
comparison continues when the same command is run again, here or on another machine that has
the committed per-run records; ``--jobs N`` trains N runs at once.
"""
from __future__ import annotations

import copy
import statistics
from dataclasses import fields
from pathlib import Path

from rankwise import registry
from rankwise.core import atomic
from rankwise.engine.callbacks import EventLog
from rankwise.recipes import folders as kinds
from rankwise.recipes import runs, sweep

INTERRUPTED = "interrupted; rerun the same command to continue"  # what Ctrl-C of compare prints
from rankwise.errors import RankwiseError, closest

SHARED_METHOD_KEYS = ("r", "alpha", "targets", "exclude", "dropout", "modules_to_save")
VARIANT_KEY = "row"  # compare: {NAME: {row: METHOD[+OPTIMIZER], ...}} names a variant row
METRICS = ("eval_accuracy", "eval_loss", "eval_perplexity", "eval_exact_match", "eval_token_accuracy",
           "trainable_params", "train_time_s", "step_time_s", "peak_memory_mb")


def parse_row(row: str, base_method: str = "lora") -> tuple[str, str | None]:
    """``(method, optimizer or None)`` of a row name (see the module docstring).

    Raises:
        RankwiseError: If a part is neither a registered method nor optimizer.
    """
    methods, optims = registry.names("method"), registry.names("optimizer")
    parts = row.split("+")
    if len(parts) == 1 and row in methods:
        return row, None
    if len(parts) == 1 and row in optims:
        return base_method, row
    if len(parts) == 2 and parts[0] in methods and parts[1] in optims:
        return parts[0], parts[1]
    bad = next((p for p in parts if p not in methods and p not in optims), row)
    raise RankwiseError(f"unknown comparison row {row!r}{closest(bad, methods + optims)}; expected "
                        f"METHOD or METHOD+OPTIMIZER with a method of {', '.join(methods)} and an "
                        f"optimizer of {', '.join(optims)}")


def row_config(base: dict, row: str, extra: dict | None = None) -> dict:
    """Return the raw run config of ``row``: ``base`` with the row's method and optimizer.

    Args:
        base: The raw base config (YAML dict, ``--set`` already applied).
        row: A row name (:func:`parse_row`).
        extra: Per-row overrides from the config's ``compare:`` section.

    Returns:
        A raw config dict (validate with ``build_run_config``).

    Raises:
        RankwiseError: On an unknown row.
    """
    base_method = dict(base.get("method") or {})
    extra = dict(extra or {})
    name, optim_name = parse_row(str(extra.pop(VARIANT_KEY, row)), base_method.get("name", "lora"))
    out = copy.deepcopy(base)
    method = {"name": name}
    valid = {f.name for f in fields(registry.get("method", name).config_cls)}
    for key in SHARED_METHOD_KEYS:
        if key in base_method and key in valid:
            method[key] = base_method[key]
    if base_method.get("name", "lora") == name:
        method = {**base_method, **method}
    out["method"] = method
    base_optim = dict(base.get("optim") or {})
    if optim_name is not None and optim_name != base_optim.get("name", "adamw"):
        # another optimizer brings its own defaults (the base lr means something else there);
        # if it has a head_lr, the base lr becomes the head's, so only the adapter's update differs
        optim = {"name": optim_name}
        valid = {f.name for f in fields(registry.get("optimizer", optim_name).config_cls)}
        if "head_lr" in valid and "lr" in base_optim:
            optim["head_lr"] = base_optim["lr"]
        out["optim"] = optim
    for section, values in extra.items():
        if not isinstance(values, dict):
            raise RankwiseError(f"compare.{row}.{section}: got {values!r}; expected a mapping")
        out[section] = {**(out.get(section) or {}), **values}
    return out


def _stats(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Mean and sample standard deviation (n - 1) of every metric over seeds, per row.

    Args:
        runs: ``{row: [metrics dict per seed]}`` as written to each run's ``metrics.json``.

    Returns:
        ``{row: {"method", "optim", "seeds", "runs", "mean": {metric: x}, "std": {metric: x}}}``.
    """
    out = {}
    for row, metrics in runs.items():
        mean, std = {}, {}
        derived = [{**m, "step_time_s": m["train_time_s"] / m["steps"]}
                   if "train_time_s" in m and m.get("steps") else m for m in metrics]
        for key in METRICS:
            vals = [float(m[key]) for m in derived if key in m]
            if vals:
                mean[key], std[key] = _stats(vals)
        out[row] = {"method": metrics[0].get("method"), "optim": metrics[0].get("optim"),
                    "seeds": len(metrics), "runs": metrics, "mean": mean, "std": std}
    return out


def _pm(s: dict, key: str, fmt: str) -> str:
    if key not in s["mean"]:
        return "-"
    return f"{format(s['mean'][key], fmt)} ± {format(s['std'][key], fmt)}"


def _percent(s: dict, key: str) -> str:
    """``mean ± std`` of a share, in percent with one decimal (``-`` when absent)."""
    if key not in s["mean"]:
        return "-"
    return f"{100 * s['mean'][key]:.1f} ± {100 * s['std'][key]:.1f}"


def markdown(summary: dict[str, dict], title: str) -> str:
    """Render the comparison table (mean ± std over seeds) as Markdown."""
    lm = any("eval_perplexity" in s["mean"] for s in summary.values())
    score = ("eval perplexity", "eval_perplexity", ".3f") if lm else ("eval accuracy (%)", "eval_accuracy", "")
    exact = lm and any("eval_exact_match" in s["mean"] for s in summary.values())  # a causal LM's
    lines = [f"## {title}", "",                                                       # greedy hits
             f"| row | method | optimizer | lr | {score[0]} | "
             + ("exact match (%) | token accuracy (%) | " if exact else "")
             + "eval loss | trainable params | step time (s) | peak memory (MiB) |",
             "|---|---|---|---:|---:|" + ("---:|---:|" if exact else "") + "---:|---:|---:|---:|"]
    for row, s in summary.items():
        if lm:
            sc = _pm(s, score[1], score[2])
        else:
            sc = _percent(s, "eval_accuracy")
        if exact:
            sc += f" | {_percent(s, 'eval_exact_match')} | {_percent(s, 'eval_token_accuracy')}"
        params = s["mean"].get("trainable_params", float("nan"))
        lr = "-" if s.get("lr") is None else f"{s['lr']:.3g}" + (" *" if "sweep" in s else "")
        lines.append(f"| {row} | {s['method']} | {s['optim']} | {lr} | {sc} | {_pm(s, 'eval_loss', '.4f')} | "
                     f"{params:,.0f} | {_pm(s, 'step_time_s', '.3f')} | {_pm(s, 'peak_memory_mb', '.0f')} |")
    n = {s["seeds"] for s in summary.values()}
    lines += ["", f"Mean ± sample standard deviation over {', '.join(map(str, sorted(n)))} seed(s) "
              "(seed k sets train.seed = k: head/adapter init, data order, GoRA's calibration batches)."]
    meters = sorted({m["memory_meter"] for s in summary.values() for m in s.get("runs", [])
                     if m.get("memory_meter")})
    if meters:
        lines += ["", f"Peak memory: the peak a run's training adds, by the meter {', '.join(meters)} "
                  "(rankwise.memory: CUDA max_memory_allocated, or on CPU the live-tensor peak from "
                  "the profiler's allocation events)."]
    if any("sweep" in s for s in summary.values()):
        lines += ["", "lr *: chosen by a sweep on seed 0 over a validation split carved from the training "
                  "data (the evaluation split was not used); the other seeds then trained at it."]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, dict], path: Path, title: str) -> Path:
    """Bar chart of the eval score (mean ± std, seeds as dots) and of the trainable parameters."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(summary)
    key = "eval_accuracy" if all("eval_accuracy" in summary[r]["mean"] for r in rows) else "eval_loss"
    fig, (ax, ax_p) = plt.subplots(1, 2, figsize=(max(7.0, 1.6 * len(rows) + 3), 3.6), dpi=110,
                                   gridspec_kw={"width_ratios": [2, 1]})
    x = range(len(rows))
    ax.bar(x, [summary[r]["mean"][key] for r in rows], yerr=[summary[r]["std"][key] for r in rows],
           capsize=4, color="#3a6ea5", alpha=0.8)
    for i, r in enumerate(rows):
        pts = [m[key] for m in summary[r]["runs"]]
        ax.plot([i] * len(pts), pts, "k.", ms=5)
    vals = [m[key] for r in rows for m in summary[r]["runs"]]
    lo, hi = min(vals), max(vals)
    pad = max(0.05 * (hi - lo), 0.01)
    ax.set_ylim(max(0.0, lo - 4 * pad), hi + 2 * pad)
    ax.set_xticks(list(x))
    ax.set_xticklabels(rows)
    ax.set_ylabel(key.replace("_", " "))
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax_p.bar(x, [summary[r]["mean"].get("trainable_params", 0) for r in rows], color="#888")
    ax_p.set_xticks(list(x))
    ax_p.set_xticklabels(rows, rotation=30)
    ax_p.set_title("trainable parameters", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def curves(out: Path, runs: dict[str, list[Path]], path: Path, title: str) -> Path | None:
    """Evaluation curves (every ``eval_every`` step), mean over seeds, one line per row.

    Args:
        out: The comparison folder.
        runs: ``{row: [run folders]}``.
        path: The PNG to write.
        title: Figure title.

    Returns:
        ``path``, or None when no run logged intermediate evaluations.
    """
    from rankwise.plots import plot_curves
    key = None
    lines: dict[str, list[tuple[float, float]]] = {}
    for row, folders in runs.items():
        per_step: dict[int, list[float]] = {}
        for folder in folders:
            events = EventLog(folder / "events.jsonl").read()
            for e in events:
                key = key or next((k for k in ("eval_accuracy", "eval_perplexity", "eval_loss") if k in e), None)
                if key and key in e:
                    per_step.setdefault(int(e["step"]), []).append(float(e[key]))
        if per_step:
            lines[row] = [(k, statistics.fmean(v)) for k, v in sorted(per_step.items())]
    if not lines or all(len(v) < 2 for v in lines.values()):
        return None
    return plot_curves(lines, path, "step", f"{key.replace('_', ' ')} (mean over seeds)", title,
                       styles={r: "o-" for r in lines})


def plan_rows(raw: dict, methods: list[str], sets: list[str]) -> tuple[dict, dict, dict]:
    """Each row's raw run config: the base config (its ``compare:`` section removed, in place),
    the row's overrides, the common ``--set`` and then the row's own ``ROW:key=value``; every
    row validated before anything trains.

    Returns:
        ``(plans, grids, base)``: ``{row: raw config}``, ``{row: lr grid from compare: or None}``
        and the base config with the common ``--set`` applied.

    Raises:
        RankwiseError: On an unknown row (also in ``compare:``) or a row whose config is invalid.
    """
    from rankwise.recipes.config import apply_sets, build_run_config
    base_method = str((raw.get("method") or {}).get("name", "lora"))
    extras = raw.pop("compare", None) or {}
    for row in extras:
        try:
            parse_row(str((extras[row] or {}).get(VARIANT_KEY, row)), base_method)
        except RankwiseError as err:
            raise RankwiseError(f"compare.{row}: {err}") from None
    for row in methods:
        if row not in extras or VARIANT_KEY not in (extras[row] or {}):
            parse_row(row, base_method)
    grids = {row: (extras.get(row) or {}).pop(sweep.GRID_KEY, None) for row in methods}
    row_sets: dict[str, list[str]] = {}
    common = []
    for item in sets:
        prefix, colon, rest = item.partition(":")
        if colon and "=" not in prefix and prefix in methods:
            row_sets.setdefault(prefix, []).append(rest)
        else:
            common.append(item)
    raw = apply_sets(raw, common)
    plans = {row: apply_sets(row_config(raw, row, extras.get(row)), row_sets.get(row, []))
             for row in methods}
    for row, plan in plans.items():
        try:
            build_run_config(copy.deepcopy(plan))
        except RankwiseError as err:
            raise RankwiseError(f"row {row!r}: {err}") from None
    return plans, grids, raw


def sweep_rows(plans: dict, grids: dict, lr_grid: int, out: Path, console, jobs: int = 1) -> dict[str, dict]:
    """Sweep every row over ``lr_grid`` learning rates on the validation split and set each
    plan's ``optim.lr`` to the best point (in place); foreign folders are refused first.

    Returns:
        ``{row: {"lr": best, "sweep": [{"lr", "eval_loss", ...}]}}`` (empty when ``lr_grid`` is 0).
    """
    points = [(row, pt) for row, plan in plans.items()
              for pt in ([sweep.sweep_plan(plan, lr) for lr in sweep.row_grid(row, plan, grids[row], lr_grid)]
                         if lr_grid else [])]
    todo = [(f"{row} sweep lr {pt['optim']['lr']:.3g} (validation split)", pt,
             out / row / f"lr{pt['optim']['lr']:.3g}") for row, pt in points]
    for _, raw_pt, run_dir in todo:
        runs.check_owned(run_dir, raw_pt)
    found: dict[str, dict[float, dict]] = {}
    for (row, pt), metrics in zip(points, runs.run_all(todo, jobs, console)):
        found.setdefault(row, {})[pt["optim"]["lr"]] = metrics
    chosen: dict[str, dict] = {}
    for row, by_lr in found.items():
        best = sweep.best_point(by_lr)
        plans[row].setdefault("optim", {})["lr"] = best
        chosen[row] = {"lr": best, "sweep": [{"lr": lr, **{k: m[k] for k in ("eval_loss", "eval_accuracy")
                                                          if k in m}} for lr, m in by_lr.items()]}
    return chosen


def run_seeds(plans: dict, seeds: int, out: Path, console, jobs: int = 1) -> dict[str, list[dict]]:
    """Train every row for seeds ``0..seeds-1`` under ``out/ROW/seedK`` (finished runs of the
    same resolved config reused, ``jobs`` at once); foreign folders are refused before anything
    trains.

    Returns:
        ``{row: [metrics of each seed]}``.
    """
    todo = []
    for row, plan in plans.items():
        for seed in range(seeds):
            raw_seed = copy.deepcopy(plan)
            raw_seed.setdefault("train", {})["seed"] = seed
            todo.append((f"{row} seed {seed}", raw_seed, out / row / f"seed{seed}"))
    for _, raw_seed, run_dir in todo:
        runs.check_owned(run_dir, raw_seed)
    by_row: dict[str, list[dict]] = {}
    for (row, _), metrics in zip(((r, k) for r in plans for k in range(seeds)),
                                 runs.run_all(todo, jobs, console)):
        by_row.setdefault(row, []).append(metrics)
    return by_row


def report(runs: dict[str, list[dict]], plans: dict, chosen: dict, base: dict, out: Path,
           console, meta: dict) -> dict:
    """Write ``results.json``, ``results.md``, ``results.png`` and ``curves.png``.

    Args:
        meta: ``config``, ``sets``, ``seeds`` and ``lr_grid`` of the comparison (stored as is).

    Returns:
        The dict written to ``results.json``.
    """
    from rankwise.recipes.config import build_run_config
    summary = summarise(runs)
    model = base.get("model", {}).get("path", "demo")
    title = f"{model} on {base.get('data', {}).get('source', 'demo')}, {meta['seeds']} seed(s)"
    for row in summary:
        summary[row]["lr"] = build_run_config(copy.deepcopy(plans[row])).optim.lr
        summary[row].update(chosen.get(row, {}))
    result = {**meta, "rows": {row: {**summary[row], "overrides": plans[row]} for row in summary}}
    atomic.write_json(out / "results.json", result)
    atomic.write_bytes(out / "results.md", markdown(summary, f"rankwise compare: {title}").encode())
    plot(summary, out / "results.png", title)
    curves(out, {row: [out / row / f"seed{k}" for k in range(meta["seeds"])] for row in summary},
           out / "curves.png", title)
    console.print(markdown(summary, title))
    console.print(f"wrote {out}/results.json, results.md and results.png")
    return result


def run_compare(config_path: Path | None, methods: list[str], seeds: int, sets: list[str],
                out: Path, console=None, base: dict | None = None, lr_grid: int = 0,
                jobs: int = 1) -> dict:
    """Run each row for seeds 0..seeds-1 and write ``results.json``, ``results.md``, ``results.png``:
    plan the rows (:func:`plan_rows`), sweep their learning rates (:func:`sweep_rows`), train
    the seeds (:func:`run_seeds`), report (:func:`report`).

    The YAML may hold a ``compare:`` section, ``{row: {section: {key: value}}}``, with per-row
    overrides (e.g. ``compare: {altlora: {optim: {lr: 0.1}}}``) and per-row learning-rate grids
    (``compare: {lora: {lr_grid: [1e-3, 3e-3, 1e-2]}}``); it is removed before the rest is
    validated as a run config.

    Args:
        config_path: The base run config (YAML); ``None`` uses ``base``.
        methods: Row names (:func:`parse_row`), e.g. ``["lora", "gora", "gora+altlora"]``.
        seeds: Number of seeds (``train.seed`` = 0..seeds-1).
        sets: ``--set`` overrides applied to the base config of every row; ``ROW:key=value``
            (``gora:method.init_lr=0.1``) applies to that row only, after its overrides.
        out: Output folder.
        console: A ``rich`` console (default: stdout).
        base: A raw config dict used when ``config_path`` is None.
        lr_grid: If > 0, sweep every row over this many learning rates on a validation split
            carved from the training data and train the seeds at the best one
            (:mod:`rankwise.recipes.sweep`); 0 trains each row at its configured rate.
        jobs: Runs trained at once, each in its own process (:func:`rankwise.recipes.runs.run_all`);
            the results do not depend on it.

    Returns:
        The dict written to ``results.json``.

    Raises:
        RankwiseError: On unknown rows, fewer than one seed, or an invalid config.
        KeyboardInterrupt: On Ctrl-C (message :data:`INTERRUPTED`), once every run checkpointed.
    """
    from rich.console import Console

    from rankwise.recipes.config import read_yaml

    console = console or Console()
    atomic.check_folder(out)
    if seeds < 1:
        raise RankwiseError(f"--seeds: got {seeds}; expected an integer >= 1")
    if not methods:
        raise RankwiseError("--methods is empty; expected a comma-separated list of rows such as "
                            "lora,gora,gora+altlora")
    raw = read_yaml(config_path) if config_path is not None else copy.deepcopy(base or {})
    plans, grids, raw = plan_rows(raw, methods, sets)
    out = Path(out)
    kinds.check_kind(out, "compare", "compare writes only into a new or empty folder or an earlier "
                       "comparison: choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    kinds.record(out, "compare")
    if lr_grid < 0:
        raise RankwiseError(f"--lr-grid: got {lr_grid}; expected 0 (off) or the number of points")
    if jobs < 1:
        raise RankwiseError(f"--jobs: got {jobs}; expected an integer >= 1")
    try:
        chosen = sweep_rows(plans, grids, lr_grid, out, console, jobs)
        metrics = run_seeds(plans, seeds, out, console, jobs)
    except KeyboardInterrupt:  # every run checkpointed; the same command reuses and continues them
        raise KeyboardInterrupt(INTERRUPTED) from None
    meta = {"config": str(config_path) if config_path else None, "sets": list(sets), "seeds": seeds,
            "lr_grid": lr_grid}
    return report(metrics, plans, chosen, raw, out, console, meta)
