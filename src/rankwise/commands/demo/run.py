"""``rankwise demo``: the embedded default job.

The packaged MiniLM (all-MiniLM-L6-v2, loaded offline) learns which of eight standard-library
packages a docstring comes from (:mod:`rankwise.data.demo`), two ways, with the same steps,
batch and data: (a) the frozen encoder with a trained classification head, (b) LoRA on every
linear layer (plus the head). It prints a table, writes ``summary.json`` and
``learning_curve.png``, and keeps each run folder (``frozen/``, ``lora/``).
"""
from __future__ import annotations

import copy
import platform
import shutil
import time
from pathlib import Path

import torch

from rankwise.core import atomic
from rankwise.data.demo import python_version
from rankwise.engine.callbacks import EventLog
from rankwise.recipes import folders, yamlfile
from rankwise.recipes.config import load_run_config
from rankwise.plots import plot_curves

DEMO_CONFIG = Path(__file__).with_name("demo.yaml")


def demo_runs() -> dict[str, dict]:
    """The demo's raw run configs by name (``demo.yaml``: ``base`` merged under each run)."""
    spec = yamlfile.load(DEMO_CONFIG.read_text())  # the run configs' reader (YAML 1.2 numbers)
    return {name: _merge(spec["base"], extra) for name, extra in spec["runs"].items()}


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def run_demo(out: Path, steps: int | None = None, console=None) -> dict:
    """Train both demo methods and write the comparison.

    Args:
        out: Output folder (previous demo output there is replaced).
        steps: Override the number of steps per method.
        console: A ``rich`` console (default: stdout).

    Returns:
        The summary written to ``summary.json``.
    """
    from rich.console import Console
    from rich.table import Table

    from rankwise.recipes.train import train

    console = console or Console()
    out = Path(out)
    folders.check_kind(out, "demo", "the demo writes only into a new or empty folder or an earlier "
                       "demo output: choose another --out")
    for name in demo_runs():
        folders.check_kind(out / name, "train", "the demo replaces only its own runs there: move it "
                           "away or choose another --out", flag="demo run folder")
    out.mkdir(parents=True, exist_ok=True)
    folders.record(out, "demo")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    began = time.perf_counter()
    results, curves = {}, {}
    for name, raw in demo_runs().items():
        if steps:
            raw["train"]["steps"] = steps
        cfg = load_run_config(None, base=raw)
        run_dir = out / name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        console.print(f"[bold]{name}[/]: {cfg.method.name} + {cfg.optim.name} (lr {cfg.optim.lr}), "
                      f"{cfg.train.steps} steps x {cfg.train.batch_size}")
        metrics = train(cfg, run_dir, console=console, summary=False)
        results[name] = metrics
        events = EventLog(run_dir / "events.jsonl").read()
        curves[name] = [(e["step"], e["eval_accuracy"]) for e in events if "eval_accuracy" in e]
    summary = {
        "python": python_version(), "torch": torch.__version__, "machine": platform.machine(),
        "cpus": torch.get_num_threads(), "total_time_s": round(time.perf_counter() - began, 1),
        "methods": {n: {k: m[k] for k in ("eval_accuracy", "eval_loss", "trainable_params", "total_params",
                                          "train_time_s", "peak_memory_mb", "steps")}
                    for n, m in results.items()},
    }
    atomic.write_json(out / "summary.json", summary)
    plot_curves(curves, out / "learning_curve.png", "step", "eval accuracy",
                "stdlib docstring topics (8 classes), MiniLM")
    table = Table(title=f"rankwise demo - Python {summary['python']}, torch {summary['torch']}")
    for col in ("method", "test accuracy", "trainable params", "train time (s)", "peak memory (MiB)"):
        table.add_column(col, justify="right" if col != "method" else "left")
    for n, m in summary["methods"].items():
        table.add_row(n, f"{m['eval_accuracy']:.1%}", f"{m['trainable_params']:,}", f"{m['train_time_s']:.1f}",
                      f"{m['peak_memory_mb']:.0f}")
    console.print(table)
    console.print(f"wrote {out}/summary.json and {out}/learning_curve.png in {summary['total_time_s']} s")
    return summary
