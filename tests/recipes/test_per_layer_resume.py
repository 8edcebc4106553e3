"""A per-layer run (``optim.per_layer``) checkpoints and resumes exactly: the optimizer is the
ordinary one, so its state dict and the checkpoint files are too. The run also sets
``train.loss_chunk_tokens`` (``rankwise train`` hands it to the task: the chunked loss runs)."""
from __future__ import annotations

import json
import shutil

import pytest

from rankwise.recipes.config import load_run_config
from rankwise.recipes.train import train

RAW = {"model": {"path": "tiny-llama", "task": "causal-lm"},
       "data": {"source": "demo", "max_length": 16, "limit": 48, "eval_fraction": 0.01},
       "method": {"name": "full"},
       "optim": {"name": "adamw", "lr": 0.003, "weight_decay": 0.1, "per_layer": True},
       "train": {"steps": 6, "batch_size": 4, "save_every": 3, "log_every": 1, "progress": False,
                 "loss_chunk_tokens": 16}}
pytestmark = pytest.mark.slow


def _losses(run) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "events.jsonl").read_text().splitlines()
            if '"loss"' in x]


def test_a_resumed_per_layer_run_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    from rankwise.engine import chunked_loss
    calls = []
    real = chunked_loss.chunked_cross_entropy
    monkeypatch.setattr(chunked_loss, "chunked_cross_entropy",
                        lambda *a: calls.append(a[3]) or real(*a))
    full = train(load_run_config(None, base=json.loads(json.dumps(RAW))), tmp_path / "full")
    part = tmp_path / "part"  # the same run (a copy), stopped after step 3
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step-0000006")  # as if it stopped after step 3
    (part / "metrics.json").unlink()
    resumed = train(load_run_config(None, base=json.loads(json.dumps(RAW))), part, resume=True)
    assert resumed["eval_loss"] == full["eval_loss"]
    assert _losses(part)[-3:] == _losses(tmp_path / "full")[-3:]
    assert calls and set(calls) == {16}
