"""``rankwise vfl CONFIG.yaml [--set vfl.KEY=VALUE ...] [--out DIR]``: one two-party
split-learning run (synchronous baseline or PubSub-VFL) from a ``vfl:`` config section.

The run folder gets ``config.yaml`` (resolved, including what ``auto`` chose),
``metrics.json`` (the accuracy curve, timings, bytes) and a one-row ``results.md``.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from rankwise.configs import from_dict
from rankwise.core import atomic
from rankwise.errors import RankwiseError
from rankwise.federated.vfl.config import VFLConfig


def load_config(config_path: Path | None, sets: list[str] | None = None, base: dict | None = None) -> VFLConfig:
    """Read and check a config whose only section is ``vfl:``.

    Raises:
        RankwiseError: An unknown section, an unknown key or a bad value (overlapping columns,
            labels with both parties, a column out of range, ...), all reported at once.
    """
    from rankwise.recipes.config import apply_sets, read_yaml
    data = read_yaml(config_path, {}) if config_path is not None else dict(base or {})  # no paths
    data = apply_sets(data, list(sets or []))
    extra = sorted(set(data) - {"vfl"})
    if extra:
        raise RankwiseError(f"vfl config: unknown section(s) {extra}; put every setting under vfl:")
    return from_dict(VFLConfig, data.get("vfl"), "vfl")


def summarise(cfg: VFLConfig, result: dict) -> dict:
    """Add the reported numbers: final accuracy, time to target, CPU use, bytes vs formula."""
    from rankwise.federated.vfl.parties import train_bytes_formula
    hit = next((r for r in result["curve"] if r["accuracy"] >= cfg.target_accuracy), None)
    t = result["traffic"]
    cores = os.cpu_count() or 1
    wall_s, cpu_s = result["wall_s"], result["cpu_s"]
    return {**result,
            "final_accuracy": result["curve"][-1]["accuracy"] if result["curve"] else None,
            "best_accuracy": max((r["accuracy"] for r in result["curve"]), default=None),
            "time_to_target_s": hit["wall_s"] if hit else None,
            "epochs_to_target": hit["epoch"] if hit else None,
            "cores": cores,
            "cpu_utilisation": cpu_s / (wall_s * cores) if wall_s > 0 else None,
            "train_bytes": t.get("embeddings", 0) + t.get("gradients", 0),
            "train_bytes_formula": train_bytes_formula(result["batch_sizes"], cfg.embed),
            "id_bytes": t.get("ids", 0), "eval_bytes": t.get("eval_embeddings", 0)}


def train(cfg: VFLConfig) -> tuple[VFLConfig, dict]:
    """Run ``cfg`` in this process.

    Returns:
        ``(the config actually run (auto's choice filled in), summary dict)``.
    """
    from rankwise.federated.vfl.parties import build_models, load_data
    from rankwise.federated.vfl.pubsub import choose_config, train_pubsub
    from rankwise.federated.vfl.sync import train_sync
    data = load_data(cfg)
    passive, active = build_models(cfg, data)
    choice = None
    if cfg.mode == "pubsub" and cfg.auto:
        choice = choose_config(cfg, data, passive, active)
        cfg = dataclasses.replace(cfg, **{k: choice[k] for k in (
            "batch_size", "workers_passive", "workers_active", "staleness", "buffer")})
    fn = train_pubsub if cfg.mode == "pubsub" else train_sync
    out = summarise(cfg, fn(cfg, data, passive, active))
    if choice is not None:
        out["auto"] = choice
    return cfg, out


def run_vfl(config_path: Path | None, sets: list[str], out: Path, base: dict | None = None) -> dict:
    """The ``rankwise vfl`` command: check the config, train, write the run folder.

    Returns:
        The ``metrics.json`` content.
    """
    from rankwise.recipes import folders, yamlfile
    out = atomic.check_folder(out)
    cfg = load_config(config_path, sets, base)
    folders.check_kind(out, "vfl", "vfl writes only into a new or empty folder: choose another --out")
    if folders.entries(out):
        raise RankwiseError(f"run folder {out} already holds a finished run; choose another --out")
    ran, metrics = train(cfg)
    out.mkdir(parents=True, exist_ok=True)
    folders.record(out, "vfl")
    atomic.write_bytes(out / "config.yaml", yamlfile.dump({"vfl": dataclasses.asdict(ran)}, sort_keys=False).encode())
    atomic.write_json(out / "metrics.json", metrics)
    tt = metrics["time_to_target_s"]
    row = (f"| {ran.mode} | {ran.dataset} | {metrics['final_accuracy']:.4f} | "
           f"{'—' if tt is None else f'{tt:.2f}'} | {metrics['wall_s']:.2f} | {metrics['cpu_utilisation']:.2f} | "
           f"{metrics['train_bytes'] / 1e6:.3f} |")
    atomic.write_bytes(out / "results.md", ("| mode | dataset | final acc. | s to target | wall s | CPU util. | MB crossed |\n"
                                            "|---|---|---|---|---|---|---|\n" + row + "\n").encode())
    return metrics
