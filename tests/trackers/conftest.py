"""Readers of what each tracker wrote, through each library's own reader, and a fixed feed of
the engine's callbacks (no training) that the unit tests log and read back.

Every reader returns the same shape: ``{"history": {key: [(step, value), ...]}, "config": dict,
"final": dict, "info": dict}``.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest


def read_tensorboard(run: Path) -> dict:
    """``RUN/tensorboard`` through TensorBoard's ``EventAccumulator``."""
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    history = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    history = {k: v for k, v in history.items() if v}  # tags whose every event a resume purged
    final = {k.removeprefix("final/"): v[-1][1] for k, v in history.items() if k.startswith("final/")}
    text = acc.Tensors("config/text_summary")[-1]  # a resumed fit writes it again
    config = yaml.safe_load(text.tensor_proto.string_val[0].decode().strip("`").removeprefix("yaml\n"))
    return {"history": {k: v for k, v in history.items() if not k.startswith("final/")},
            "config": config, "final": final, "info": {}}


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (``run-ID.wandb``), parsed with W&B's own protobuf
    ``Record``: the file is W&B's 7-byte header (``:W&B``, magic, version) and then LevelDB-log
    framing (32 KiB blocks of chunks: crc32 u32, length u16, type u8 = full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pb.Record.FromString(pending))
    return records


def read_wandb(run: Path) -> dict:
    """The newest offline W&B run in ``RUN/wandb``: history, config, summary and run info."""
    import time
    [path] = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))[-1:]
    history: dict[str, list] = {}
    config, final, info = {}, {}, {}

    def key(item):
        return item.key or ".".join(item.nested_key)

    for _ in range(100):  # W&B's service may still be writing the log when finish() returns
        try:
            records = wandb_records(path)
        except Exception:  # a record cut short mid-write
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {key(i): json.loads(i.value_json) for i in rec.history.item}
            for k, v in row.items():
                if not k.startswith("_"):
                    history.setdefault(k, []).append((row["_step"], v))
        elif kind == "run":
            info = {"project": rec.run.project, "name": rec.run.display_name, "tags": list(rec.run.tags),
                    "mode": "offline"}
            config.update({key(i): json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            config.update({key(i): json.loads(i.value_json) for i in rec.config.update})
        elif kind == "summary":
            final.update({key(i): json.loads(i.value_json) for i in rec.summary.update})
        elif kind == "exit":
            info["exit_code"] = rec.exit.exit_code
    config.pop("_wandb", None)
    return {"history": history, "config": config, "final": final, "info": info}


def read_mlflow(run: Path, uri: str | None = None) -> dict:
    """The one run of ``RUN/mlruns`` (or ``uri``) through ``MlflowClient``."""
    import os

    import yaml
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri or (run / "mlruns").resolve().as_uri())
    [exp] = [e for e in client.search_experiments() if e.name != "Default"]
    [found] = client.search_runs([exp.experiment_id])
    rid, data = found.info.run_id, found.data
    history = {k: [(m.step, m.value) for m in client.get_metric_history(rid, k)] for k in data.metrics}
    final = {k: v[-1][1] for k, v in history.items() if "/" not in k}
    final.update({k: v for k, v in data.tags.items() if not k.startswith("mlflow.")})
    folder = Path(client.download_artifacts(rid, "config.yaml", str(run / "mlflow-read")))
    return {"history": {k: v for k, v in history.items() if "/" in k},
            "config": yaml.safe_load(folder.read_text()), "final": final,
            "info": {"experiment": exp.name, "name": data.tags.get("mlflow.runName"),
                     "status": found.info.status, "params": data.params,
                     "tags": {k: v for k, v in data.tags.items() if not k.startswith("mlflow.")}}}


READERS = {"tensorboard": read_tensorboard, "wandb": read_wandb, "mlflow": read_mlflow}

# The feed: 4 steps logged every 2nd step (and the last), evaluations after steps 2 and 4.
CONFIG = {"train": {"steps": 4, "lr": 0.5, "log_to": ["x"]}, "model": {"path": "/tmp/m"}}
FINAL = {"eval_loss": 0.25, "steps": 4, "trainable_params": 12, "method": "lora"}


def expected() -> dict:
    """What :func:`feed` logs: ``{key: [(step, value)]}``."""
    return {"train/loss": [(2, 1 / 2), (4, 1 / 4)], "train/lr": [(2, 0.2), (4, 0.4)],
            "train/balance": [(2, 0.02), (4, 0.04)], "train/reward": [(2, 2.0), (4, 4.0)],
            "eval/loss": [(2, 0.5), (4, 0.25)], "eval/accuracy": [(2, 0.625), (4, 0.75)]}


def feed(tracker, total: int = 4, every: int = 2, crash_after: int | None = None) -> SimpleNamespace:
    """Drive ``tracker`` through a fit as the engine does: start, steps (loss ``1/s``, lr
    ``s/10``, an auxiliary loss and a task measurement), two evaluations, the end, the final
    metrics. ``crash_after``: leave the loop after that step as a failure does. Returns the
    fit's state."""
    tracker.every = every
    state = SimpleNamespace(step=0, start_step=0, total_steps=total, last_eval=None, stopped_at=None,
                            began=0.0)
    engine = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"lr": 0.0}]))
    tracker.on_fit_start(engine, state)
    for s in range(1, total + 1):
        state.step, engine.optimizer.param_groups[0]["lr"] = s, s / 10
        if s % 2 == 0:
            state.last_eval = {"eval_loss": 1 / s, "eval_accuracy": 0.5 + s / 16}
        result = SimpleNamespace(loss=1 / s, aux={"balance": s / 100}, metrics={"reward": float(s)})
        tracker.on_step_end(engine, state, result)
        if crash_after == s:
            tracker.on_fit_exit(engine, state)
            return state
    state.stopped_at = 1.0
    tracker.on_fit_exit(engine, state)
    tracker.on_fit_end(engine, state)
    tracker.finish(dict(FINAL))
    return state


@pytest.fixture
def fed():
    """``(feed, expected(), CONFIG, FINAL, READERS)``."""
    return SimpleNamespace(feed=feed, expected=expected(), config=CONFIG, final=FINAL, readers=READERS)
