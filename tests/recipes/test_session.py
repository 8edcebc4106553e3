"""``train.compile`` through the recipe (:mod:`rankwise.recipes.session`): a compiled run on
variable-length data, stopped and resumed, equals the uninterrupted compiled run; ``auto`` on a
3-step run stays eager and says why with its numbers."""
from __future__ import annotations

import io
import json
import re
import shutil

import pytest

from rankwise.recipes.config import load_run_config
from rankwise.recipes.session import compile_buckets
from rankwise.recipes.train import train

RAW = {"model": {"path": "tiny-llama", "task": "causal-lm"},
       "data": {"source": "demo", "max_length": 48, "limit": 48, "eval_fraction": 0.05},
       "method": {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"]},
       "optim": {"name": "adamw", "lr": 0.003},
       "train": {"steps": 6, "batch_size": 4, "save_every": 3, "log_every": 1, "progress": False,
                 "eval_batch_size": 8, "compile": True, "compile_buckets": [16, 32]}}
pytestmark = pytest.mark.slow


def _cfg(**train_over):
    raw = json.loads(json.dumps(RAW))
    raw["train"].update(train_over)
    return load_run_config(None, base=raw)


def _losses(run) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "events.jsonl").read_text().splitlines()
            if '"loss"' in x]


def test_a_resumed_compiled_run_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    from rankwise.engine import compile as comp
    monkeypatch.setattr(comp, "BACKEND", "aot_eager")      # dynamo + AOTAutograd, no codegen
    assert compile_buckets(_cfg()) == (16, 32, 48)
    full = train(_cfg(), tmp_path / "full")
    part = tmp_path / "part"  # the same run (a copy: a second compiled run trains as the first)
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step-0000006")  # as if it stopped after step 3
    (part / "metrics.json").unlink()
    resumed = train(_cfg(), part, resume=True)
    assert resumed["eval_loss"] == full["eval_loss"]
    assert _losses(part)[-3:] == _losses(tmp_path / "full")[-3:]


def test_auto_stays_eager_on_a_three_step_run_and_says_why(tmp_path):
    from rich.console import Console
    out = io.StringIO()
    train(_cfg(compile="auto", steps=3), tmp_path / "auto", console=Console(file=out, width=400))
    text = out.getvalue()
    line = next(x for x in text.splitlines() if x.startswith("train.compile auto:"))
    assert re.fullmatch(r"train\.compile auto: eager \(2 timed eager steps at \d+ ms; 0 steps left "
                        r"x 17% saved = 0\.0 s <= ~\d+ s to compile 3 buckets x 1 block kind\)", line)
    assert "first bucket compiled" not in text
