"""Shared pieces of the demo-task comparisons ``rankwise bench lota-qaf`` and
``rankwise bench nanoadam-ft``: one (row, seed) training run through ``rankwise train``'s own
pipeline (with an optional hook that changes the loaded base model first), evaluation of a
changed model on the run's evaluation split, byte counts, and mean/std tables over seeds."""
from __future__ import annotations

import copy
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torch import nn

from rankwise.engine import evaluate
from rankwise.errors import RankwiseError
from rankwise.memory import tensor_bytes
from rankwise.optim.common import state_bytes

# The demo task at the budget of examples/compare-demo.yaml: the packaged MiniLM, stdlib
# docstrings of 8 packages, 40 steps x 32 examples, sequences of 32 tokens.
DEMO_BASE = {
    "model": {"path": "demo"},
    "task": {"name": "classification"},
    "data": {"source": "demo", "max_length": 32, "eval_fraction": 0.2},
    "train": {"steps": 40, "batch_size": 32, "eval_batch_size": 128, "eval_every": 0, "save_every": 0,
              "log_every": 5, "warmup_fraction": 0.05, "progress": False},
}


@dataclass
class Settings:
    """The size of a demo comparison (tests and smoke runs shrink it).

    Attributes:
        seeds: Seeds per row (``train.seed`` = 0..seeds-1).
        steps: Training steps (``None``: the base config's).
        model: ``model.path`` (``None``: the base config's; ``tiny-bert`` for smoke tests).
        limit: ``data.limit`` (training records), ``None`` for all.
        rows: Rows to run (``None``: the benchmark's default rows).
    """

    seeds: int = 3
    steps: int | None = None
    model: str | None = None
    limit: int | None = None
    rows: tuple[str, ...] | None = None


def chosen_rows(bench: str, requested: Any, known: dict,
                default: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The rows to run: ``requested`` (default: ``default``, else every known row), each checked.

    Raises:
        RankwiseError: Naming the rows ``bench`` does not know.
    """
    rows = tuple(requested or default or known)
    unknown = [r for r in rows if r not in known]
    if unknown:
        raise RankwiseError(f"{bench} rows: got {unknown}; expected some of {list(known)}")
    return rows


def with_settings(raw: dict, s: Settings, seed: int) -> dict:
    """``raw`` with the settings' size and ``train.seed = seed`` applied (a copy)."""
    out = copy.deepcopy(raw)
    out.setdefault("train", {})["seed"] = seed
    if s.steps is not None:
        out["train"]["steps"] = s.steps
        if "total_steps" in out.get("optim", {}):
            out["optim"]["total_steps"] = s.steps
    if s.model is not None:
        out.setdefault("model", {})["path"] = s.model
    if s.limit is not None:
        out.setdefault("data", {})["limit"] = s.limit
    return out


def run_row(raw: dict, out: Path, base_hook: Callable[[nn.Module], Any] | None = None):
    """Train one run as ``rankwise train`` would, after ``base_hook(model)`` changed the loaded
    base (e.g. quantized it); reuses a finished run with the same plan.

    Returns:
        ``(metrics, session)``; the session holds the trained model and the optimizer.
    """
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.model import load_model
    from rankwise.recipes.train import prepare, train
    from rankwise.engine import get_task
    from rich.console import Console
    cfg = build_run_config(copy.deepcopy(raw))
    task = get_task(cfg.task.name)
    model = tok = None
    if base_hook is not None:
        from rankwise.data.demo import PACKAGES
        labels = cfg.model.num_labels or (len(PACKAGES) if cfg.data.source == "demo" else None)
        model, tok = load_model(cfg.model.path, task, labels, seed=cfg.train.seed)
        base_hook(model)
    session = prepare(cfg, model=model, tokenizer=tok)
    metrics = train(cfg, out, session=session, console=Console(stderr=True, quiet=True), summary=False)
    return metrics, session


def accuracy(model: nn.Module, session, data=None) -> float:
    """``eval_accuracy`` of ``model`` on ``data`` (default: the session's evaluation split)."""
    data = session.eval_data if data is None else data
    return float(evaluate(model, session.task, data, session.cfg.train.eval_batch_size,
                          session.device)["eval_accuracy"])


def memory_record(session, metrics: dict) -> dict:
    """Bytes of the model's storage (packed codes count packed), of its trainable weights and
    of the optimizer state, with the run's peak memory."""
    trainable = [p for p in session.model.parameters() if p.requires_grad]
    return {"model_bytes": tensor_bytes(session.model),
            "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable),
            "state_bytes": state_bytes(session.optimizer),
            "peak_memory_mb": metrics.get("peak_memory_mb"), "memory_meter": metrics.get("memory_meter")}


def summarise(records: dict[str, list[dict]], keys: tuple[str, ...]) -> dict[str, dict]:
    """``{row: {key: (mean, sample std)}}`` over seeds."""
    out = {}
    for row, recs in records.items():
        out[row] = {}
        for k in keys:
            vals = [float(r[k]) for r in recs if r.get(k) is not None]
            if vals:
                out[row][k] = (statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0)
    return out


def markdown_table(summary: dict[str, dict], columns: list[tuple[str, str, Callable[[float], str]]]) -> str:
    """A Markdown table of ``mean ± std`` cells: ``columns`` is ``[(key, header, format)]``."""
    lines = ["| row | " + " | ".join(h for _, h, _ in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for row, stats in summary.items():
        cells = []
        for key, _, fmt in columns:
            if key in stats:
                mean, std = stats[key]
                cells.append(f"{fmt(mean)} ± {fmt(std)}")
            else:
                cells.append("-")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(out: Path, result: dict, md: str) -> None:
    """Write ``results.json`` and ``results.md``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=float))
    (out / "results.md").write_text(md)


def main(run: Callable[[Path, Settings], dict], rows: tuple[str, ...], argv: list[str] | None = None) -> int:
    """Command line of a demo comparison: ``python -m rankwise.benchmarks.<name> --out DIR
    [--rows a,b] [--seeds N] [--steps N] [--model PATH] [--limit N]``; user errors end with one
    line and exit code 2.

    Args:
        run: The benchmark's ``run(out, settings)``.
        rows: Its row names (for the help text).
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code.
    """
    import argparse
    import sys

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=None, help=f"comma-separated rows of {list(rows)}")
    ap.add_argument("--seeds", type=int, default=Settings.seeds)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--limit", type=int, default=None)
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    chosen = tuple(r.strip() for r in a.rows.split(",") if r.strip()) if a.rows else None
    try:
        run(Path(a.out), Settings(a.seeds, a.steps, a.model, a.limit, chosen))
    except RankwiseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}/results.json and {a.out}/results.md")
    return 0


def pct(x: float) -> str:
    """``0.734`` -> ``"73.4"``."""
    return f"{100 * x:.1f}"


def mib(x: float) -> str:
    """Bytes as MiB with two decimals."""
    return f"{x / 2**20:.2f}"


