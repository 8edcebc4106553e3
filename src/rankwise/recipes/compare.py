"""``rankwise compare``: several methods on one task, the same budget, several seeds.

A *row* is what a user names on the command line (``lora``, ``gora``, ``altlora``...). Each
row is a set of run-config overrides in :data:`ROWS`, the one table that maps a row to its
(method, optimizer) pair; later methods add a line there and nothing else.

Same budget: the base config's shared method settings (``r``, ``alpha``, ``targets``,
``exclude``, ``dropout``, ``modules_to_save``) are carried into every row whose method
config has those fields, so LoRA at rank r, GoRA with r0 = r (budget sum (m+n)·r) and AltLoRA
over the same LoRA train the same number of adapter weights (up to GoRA's rounding).

Output folder: ``<row>/seed<k>/`` (ordinary run folders), ``results.json``, ``results.md``
and ``results.png``. Finished runs (``metrics.json`` and the same ``compare_plan.json``) are
reused and unfinished ones restarted, so an interrupted comparison continues when the same
command is run again.
"""
from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path
from typing import Any

from rankwise.core import atomic
from rankwise.errors import RankwiseError, closest

# row -> overrides of the base run config. A row that names another optimizer brings its
# whole ``optim`` section (the base optimizer's lr means something else there); if that
# optimizer has ``head_lr``, the base lr becomes the head's, so only the adapter's update differs.
ROWS: dict[str, dict[str, Any]] = {
    "frozen": {"method": {"name": "frozen"}},
    "lora": {"method": {"name": "lora"}},
    "gora": {"method": {"name": "gora"}},
    "altlora": {"method": {"name": "lora"}, "optim": {"name": "altlora", "lr": 1.0, "reg": 1e-3}},
    "altlora-plus": {"method": {"name": "lora"},
                     "optim": {"name": "altlora-plus", "lr": 5e-4, "reg": 1e-3}},
    "gora+altlora": {"method": {"name": "gora"},
                     "optim": {"name": "altlora", "lr": 1.0, "reg": 1e-3}},
    "full": {"method": {"name": "full"}, "optim": {"name": "adamw", "lr": 5e-5}},
    # full training with low-rank optimizer state; scale 1 / RMS-matched SUMO keep full's lr
    "full+galore": {"method": {"name": "full"},
                    "optim": {"name": "galore", "lr": 5e-5, "scale": 1.0, "rank": 64, "update_every": 50}},
    "full+sumo": {"method": {"name": "full"},
                  "optim": {"name": "sumo", "lr": 5e-5, "rank": 64, "update_every": 50}},
}
SHARED_METHOD_KEYS = ("r", "alpha", "targets", "exclude", "dropout", "modules_to_save")
METRICS = ("eval_accuracy", "eval_loss", "eval_perplexity", "trainable_params", "train_time_s",
           "peak_memory_mb")


def row_config(base: dict, row: str, extra: dict | None = None) -> dict:
    """Return the raw run config of ``row``: ``base`` with the row's overrides applied.

    Args:
        base: The raw base config (YAML dict, ``--set`` already applied).
        row: A key of :data:`ROWS`.
        extra: Per-row overrides from the config's ``compare:`` section.

    Returns:
        A raw config dict (validate with ``build_run_config``).

    Raises:
        RankwiseError: On an unknown row (listing the known ones).
    """
    from dataclasses import fields

    from rankwise import registry

    if row not in ROWS:
        raise RankwiseError(f"unknown comparison row {row!r}{closest(row, ROWS)}; expected one of: "
                            f"{', '.join(ROWS)}")
    spec = ROWS[row]
    out = copy.deepcopy(base)
    base_method = dict(base.get("method") or {})
    method = dict(spec["method"])
    valid = {f.name for f in fields(registry.get("method", method["name"]).config_cls)}
    for key in SHARED_METHOD_KEYS:
        if key in base_method and key in valid and key not in method:
            method[key] = base_method[key]
    if base_method.get("name", "lora") == method["name"]:
        method = {**base_method, **method}
    out["method"] = method
    if "optim" in spec:
        base_optim = dict(base.get("optim") or {})
        same = base_optim.get("name", "adamw") == spec["optim"]["name"]
        optim = {**base_optim, **spec["optim"]} if same else dict(spec["optim"])
        valid = {f.name for f in fields(registry.get("optimizer", optim["name"]).config_cls)}
        if not same and "head_lr" in valid and "head_lr" not in optim and "lr" in base_optim:
            optim["head_lr"] = base_optim["lr"]  # the head trains exactly as in the base row
        out["optim"] = optim
    for section, values in (extra or {}).items():
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
        for key in METRICS:
            vals = [float(m[key]) for m in metrics if key in m]
            if vals:
                mean[key], std[key] = _stats(vals)
        out[row] = {"method": metrics[0].get("method"), "optim": metrics[0].get("optim"),
                    "seeds": len(metrics), "runs": metrics, "mean": mean, "std": std}
    return out


def _pm(s: dict, key: str, fmt: str) -> str:
    if key not in s["mean"]:
        return "-"
    return f"{format(s['mean'][key], fmt)} ± {format(s['std'][key], fmt)}"


def markdown(summary: dict[str, dict], title: str) -> str:
    """Render the comparison table (mean ± std over seeds) as Markdown."""
    lm = any("eval_perplexity" in s["mean"] for s in summary.values())
    score = ("eval perplexity", "eval_perplexity", ".3f") if lm else ("eval accuracy (%)", "eval_accuracy", "")
    lines = [f"## {title}", "",
             f"| row | method | optimizer | {score[0]} | eval loss | trainable params | "
             "train time (s) | peak memory (MiB) |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for row, s in summary.items():
        if lm:
            sc = _pm(s, score[1], score[2])
        else:
            sc = (f"{100 * s['mean']['eval_accuracy']:.1f} ± {100 * s['std']['eval_accuracy']:.1f}"
                  if "eval_accuracy" in s["mean"] else "-")
        params = s["mean"].get("trainable_params", float("nan"))
        lines.append(f"| {row} | {s['method']} | {s['optim']} | {sc} | {_pm(s, 'eval_loss', '.4f')} | "
                     f"{params:,.0f} | {_pm(s, 'train_time_s', '.1f')} | {_pm(s, 'peak_memory_mb', '.0f')} |")
    n = {s["seeds"] for s in summary.values()}
    lines += ["", f"Mean ± sample standard deviation over {', '.join(map(str, sorted(n)))} seed(s) "
              "(seed k sets train.seed = k: head/adapter init, data order, GoRA's calibration batches)."]
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


PLAN = "compare_plan.json"


def _run_one(raw: dict, run_dir: Path, console) -> dict:
    """Train one (row, seed) run, or reuse it if it finished earlier with the same plan."""
    import shutil

    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.train import train

    cfg = build_run_config(copy.deepcopy(raw))
    plan = json.loads(json.dumps(raw))
    if (run_dir / "metrics.json").is_file():
        saved = json.loads((run_dir / PLAN).read_text()) if (run_dir / PLAN).is_file() else None
        if saved == plan:
            console.print(f"{run_dir}: finished earlier with the same settings, reusing metrics.json")
            return json.loads((run_dir / "metrics.json").read_text())
        raise RankwiseError(f"{run_dir} holds a finished run with other settings; choose another "
                            "--out or delete that folder")
    if run_dir.exists():  # an interrupted run of this comparison: start it again
        shutil.rmtree(run_dir)
    metrics = train(cfg, run_dir, console=console)
    atomic.write_json(run_dir / PLAN, plan)
    return metrics


def run_compare(config_path: Path | None, methods: list[str], seeds: int, sets: list[str],
                out: Path, console=None, base: dict | None = None) -> dict:
    """Run each row for seeds 0..seeds-1 and write ``results.json``, ``results.md``, ``results.png``.

    The YAML may hold a ``compare:`` section, ``{row: {section: {key: value}}}``, with per-row
    overrides (e.g. ``compare: {altlora: {optim: {lr: 0.1}}}``); it is removed before the rest
    is validated as a run config.

    Args:
        config_path: The base run config (YAML); ``None`` uses ``base``.
        methods: Row names (keys of :data:`ROWS`), e.g. ``["lora", "gora", "altlora"]``.
        seeds: Number of seeds (``train.seed`` = 0..seeds-1).
        sets: ``--set`` overrides applied to the base config of every row; ``ROW:key=value``
            (``gora:method.init_lr=0.1``) applies to that row only, after its overrides.
        out: Output folder.
        console: A ``rich`` console (default: stdout).
        base: A raw config dict used when ``config_path`` is None.

    Returns:
        The dict written to ``results.json``.

    Raises:
        RankwiseError: On unknown rows, fewer than one seed, or an invalid config.
    """
    from rich.console import Console

    from rankwise.recipes.config import apply_sets, build_run_config, read_yaml

    console = console or Console()
    if seeds < 1:
        raise RankwiseError(f"--seeds: got {seeds}; expected an integer >= 1")
    if not methods:
        raise RankwiseError(f"--methods is empty; expected a comma-separated list of: {', '.join(ROWS)}")
    bad = [m for m in methods if m not in ROWS]
    if bad:
        raise RankwiseError(f"unknown comparison row {bad[0]!r}{closest(bad[0], ROWS)}; expected "
                            f"one of: {', '.join(ROWS)}")
    raw = read_yaml(config_path) if config_path is not None else copy.deepcopy(base or {})
    extras = raw.pop("compare", None) or {}
    unknown = [k for k in extras if k not in ROWS]
    if unknown:
        raise RankwiseError(f"compare.{unknown[0]}: unknown row{closest(unknown[0], ROWS)}; "
                            f"expected one of: {', '.join(ROWS)}")
    row_sets: dict[str, list[str]] = {}
    common = []
    for item in sets:
        prefix, colon, rest = item.partition(":")
        if colon and "=" not in prefix and prefix in ROWS:
            row_sets.setdefault(prefix, []).append(rest)
        else:
            common.append(item)
    raw = apply_sets(raw, common)
    plans = {row: apply_sets(row_config(raw, row, extras.get(row)), row_sets.get(row, []))
             for row in methods}
    for row, plan in plans.items():  # validate every row before training anything
        try:
            build_run_config(copy.deepcopy(plan))
        except RankwiseError as err:
            raise RankwiseError(f"row {row!r}: {err}") from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {}
    for row, plan in plans.items():
        for seed in range(seeds):
            raw_seed = copy.deepcopy(plan)
            raw_seed.setdefault("train", {})["seed"] = seed
            console.print(f"[bold]{row}[/] seed {seed}")
            runs.setdefault(row, []).append(_run_one(raw_seed, out / row / f"seed{seed}", console))
    summary = summarise(runs)
    model = raw.get("model", {}).get("path", "demo")
    title = f"{model} on {raw.get('data', {}).get('source', 'demo')}, {seeds} seed(s)"
    result = {"config": str(config_path) if config_path else None, "sets": list(sets), "seeds": seeds,
              "rows": {row: {**summary[row], "overrides": plans[row]} for row in summary}}
    atomic.write_json(out / "results.json", result)
    atomic.write_bytes(out / "results.md", markdown(summary, f"rankwise compare: {title}").encode())
    plot(summary, out / "results.png", title)
    console.print(markdown(summary, title))
    console.print(f"wrote {out}/results.json, results.md and results.png")
    return result
