"""``rankwise federated CONFIG.yaml [--set ...] [--out DIR]``: a federated run on Flower's
simulation engine.

Engine choice: ``flwr.simulation.run_simulation`` runs the same ServerApp and ClientApp as a
deployment on Flower's simulation runtime (Ray actors as virtual SuperNodes) inside this
process. It is deprecated in favour of ``flwr run`` but present in flwr 1.42; ``flwr run``
needs an app folder with a ``pyproject.toml`` and a background SuperLink, which is the
deployment recipe in ``docs/federated.md`` (the same apps, unchanged).

The run folder gets ``config.yaml`` (resolved; the clients read it), ``rounds.jsonl``,
``metrics.json``, ``results.md`` and ``accuracy_vs_bytes.png`` (``loss_vs_bytes.png`` for a task
without accuracy, such as causal-lm).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path


from rankwise import registry
from rankwise.configs import from_dict
from rankwise.core import atomic
from rankwise.errors import RankwiseError
from rankwise.federated.config import FederatedConfig
from rankwise.recipes import yamlfile


def resolve(config_path: Path | None, sets: list[str], base: dict | None = None):
    """Load and check a federated run config.

    Returns:
        ``(RunConfig, FederatedConfig)``.

    Raises:
        RankwiseError: On any problem in any section, the strategy name or its options, and on
            each run setting federated training does not follow
            (:func:`rankwise.federated.task.train_problems`), all in one message.
    """
    from rankwise.federated.task import train_problems
    from rankwise.recipes.config import load_run_config
    cfg = load_run_config(config_path, sets, base)
    fed = cfg.federated or FederatedConfig()  # validated with the run config
    entry = registry.get("strategy", fed.strategy_name())
    from_dict(entry.config_cls, {"name": entry.name, **fed.strategy_options()}, "federated.strategy")
    problems = train_problems(cfg, fed)
    if entry.builder.needs_factors and not registry.get("method", cfg.method.name).factorized:
        factorized = [n for n in registry.names("method") if registry.get("method", n).factorized]
        problems.append(f"federated.strategy {entry.name} needs method.name: lora (or another method "
                        f"with low-rank factors: {', '.join(factorized)}); got {cfg.method.name!r}")
    bad = [p for p in fed.faults if int(p) >= fed.clients]
    if bad:
        problems.append(f"federated.faults: partitions {bad} do not exist; expected 0..{fed.clients - 1}")
    if problems:
        raise RankwiseError("; ".join(problems))
    return cfg, fed


def write_config(cfg, fed: FederatedConfig, out: Path) -> Path:
    """Write the resolved run config (with the full ``federated`` section) to ``out/config.yaml``."""
    data = cfg.to_dict()
    data["federated"] = dataclasses.asdict(fed)
    path = out / "config.yaml"
    atomic.write_bytes(path, yamlfile.dump(data, sort_keys=False).encode())  # reads back as written
    return path


def simulate(config_file: Path, out: Path, fed: FederatedConfig, resume: bool = False) -> None:
    """Run the ServerApp and ClientApp on Flower's simulation runtime (one process + Ray);
    ``resume`` continues from the newest round checkpoint in ``out``."""
    from flwr.simulation import run_simulation

    from rankwise.federated.client_app import ENV_CONFIG
    from rankwise.federated.client_app import app as client_app
    from rankwise.federated.server_app import ENV_OUT, ENV_RESUME
    from rankwise.federated.server_app import app as server_app
    os.environ[ENV_CONFIG] = str(config_file.resolve())
    os.environ[ENV_OUT] = str(out.resolve())
    os.environ[ENV_RESUME] = "1" if resume else "0"
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray runs workers at niceness 15 by default; on a shared CPU the clients then starve.
    os.environ.setdefault("RAY_worker_niceness", "0")
    cpus = max(1, os.cpu_count() or 1)
    backend = {"client_resources": {"num_cpus": min(fed.client_cpus, cpus), "num_gpus": 0.0},
               "init_args": {"num_cpus": cpus, "num_gpus": 0, "include_dashboard": False}}
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=fed.clients,
                   backend_config=backend)
    if not (out / "metrics.json").is_file():
        raise RuntimeError(f"the federation ended without writing {out / 'metrics.json'}; see the log above")


def read_rounds(run: Path) -> list[dict]:
    """The lines of a run folder's ``rounds.jsonl``."""
    return [json.loads(line) for line in (Path(run) / "rounds.jsonl").read_text().splitlines() if line]


def write_results(runs: dict[str, Path], out: Path, title: str = "federated runs") -> dict:
    """Results table (``results.md``, ``results.json``) and the metric-vs-bytes plot of runs:
    ``accuracy_vs_bytes.png`` (global eval accuracy), or ``loss_vs_bytes.png`` (global eval loss)
    when no run has an accuracy (causal-lm).

    Args:
        runs: ``{label: run folder}``.
        out: Folder to write into.
        title: Plot title.

    Returns:
        ``{label: summary row}``.
    """
    from rankwise.plots import plot_curves
    out.mkdir(parents=True, exist_ok=True)
    rows, curves = {}, {}
    for label, folder in runs.items():
        m = json.loads((Path(folder) / "metrics.json").read_text())
        lines = read_rounds(folder)
        trained = max(m["rounds"], 1)
        rows[label] = {"strategy": m["strategy"], "eval_accuracy": m.get("eval_accuracy"),
                       "eval_loss": m.get("eval_loss"),
                       "initial_eval_accuracy": m.get("initial_eval_accuracy"),
                       "majority_accuracy": m.get("majority_accuracy"), "rounds": m["rounds"],
                       "bytes_up": m["bytes_up"], "bytes_down": m["bytes_down"],
                       "bytes_total": m["bytes_total"], "bytes_per_round": m["bytes_total"] / trained,
                       "rejected": m["rejected"], "failed": m["failed"], "missing": m["missing"],
                       "wall_time_s": m.get("wall_time_s"),
                       "per_round": [{k: e.get(k) for k in ("round", "eval_accuracy", "eval_loss", "bytes_up",
                                                             "bytes_down", "cum_bytes", "aggregated")}
                                     for e in lines]}
        for key in ("eval_accuracy", "eval_loss"):
            if any(key in e for e in lines):
                curves.setdefault(key, {})[label] = [(e["cum_bytes"] / 1e6, e[key]) for e in lines if key in e]
    # runs recorded before majority_accuracy existed keep their table as it was
    majority = any(r["majority_accuracy"] is not None for r in rows.values())
    md = ["| run | strategy | final acc. | initial acc. | " + ("majority | " if majority else "")
          + "final eval loss | rounds | MB up | MB down | MB total | MB/round |",
          "|---|---|---|---|" + ("---|" if majority else "") + "---|---|---|---|---|---|"]
    for label, r in rows.items():
        acc = "—" if r["eval_accuracy"] is None else f"{r['eval_accuracy']:.4f}"
        init = "—" if r["initial_eval_accuracy"] is None else f"{r['initial_eval_accuracy']:.4f}"
        major = "—" if r["majority_accuracy"] is None else f"{r['majority_accuracy']:.4f}"
        loss = "—" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
        md.append(f"| {label} | {r['strategy']} | {acc} | {init} | " + (f"{major} | " if majority else "")
                  + f"{loss} | {r['rounds']} | {r['bytes_up'] / 1e6:.3f} | {r['bytes_down'] / 1e6:.3f} | "
                  f"{r['bytes_total'] / 1e6:.3f} | {r['bytes_per_round'] / 1e6:.3f} |")
    atomic.write_bytes(out / "results.md", ("\n".join(md) + "\n").encode())
    atomic.write_json(out / "results.json", rows)
    if curves.get("eval_accuracy"):
        plot_curves(curves["eval_accuracy"], out / "accuracy_vs_bytes.png", "cumulative MB sent (up + down)",
                    "global eval accuracy", title)
    elif curves.get("eval_loss"):  # causal-lm: no accuracy, the loss tells the same story
        plot_curves(curves["eval_loss"], out / "loss_vs_bytes.png", "cumulative MB sent (up + down)",
                    "global eval loss", title)
    return rows


def run_federated(config_path: Path | None, sets: list[str], out: Path, base: dict | None = None,
                  resume: bool = False) -> dict:
    """Run a federated fine-tuning from a run config (the ``rankwise federated`` command).

    Args:
        config_path: YAML run config with a ``federated`` section (``None``: use ``base``).
        sets: ``--set`` overrides (``federated.strategy=rolora``).
        out: The run folder (must not hold a finished run).
        base: A raw config dict used instead of a file (tests, the benchmark).
        resume: Continue the run in ``out`` from its newest round checkpoint; the config must
            be the one the run was started with.

    Returns:
        The run's ``metrics.json`` content.

    Raises:
        RankwiseError: On config problems, an occupied run folder, or a resume that does not
            match the folder.
    """
    from rankwise.federated.checkpoint import list_rounds
    out = atomic.check_folder(out)
    cfg, fed = resolve(config_path, sets, base)
    from rankwise.recipes import folders
    if folders.kind(out) not in (None, "federated"):
        raise RankwiseError(f"{out} is not empty and holds no federated run (it holds "
                            f"{folders.what(folders.kind(out))}); choose another --out")
    if (out / "metrics.json").exists():
        raise RankwiseError(f"run folder {out} already holds a finished run; choose another --out")
    if resume:
        if not list_rounds(out):
            raise RankwiseError(f"{out} has no completed round to resume from; run without --resume")
        saved = yamlfile.load((out / "config.yaml").read_text()) if (out / "config.yaml").is_file() else None
        now = yamlfile.load(yamlfile.dump({**cfg.to_dict(), "federated": dataclasses.asdict(fed)}))
        if saved != now:
            diff = sorted(k for k in set(saved or {}) | set(now) if (saved or {}).get(k) != now.get(k))
            raise RankwiseError(f"the config differs from {out / 'config.yaml'} in {diff}; resume with "
                                f"the run's own config: rankwise federated {out / 'config.yaml'} --out {out} --resume")
    elif list_rounds(out):
        raise RankwiseError(f"{out} holds an interrupted federated run; continue it with --resume "
                            "or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    folders.record(out, "federated")
    config_file = out / "config.yaml" if resume else write_config(cfg, fed, out)
    simulate(config_file, out, fed, resume=resume)
    write_results({fed.strategy_name(): out}, out, title=f"{fed.strategy_name()} ({fed.partition})")
    return json.loads((out / "metrics.json").read_text())
