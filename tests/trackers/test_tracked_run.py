"""One training run through the recipe API with every tracker at once; each tracker's own
reader gives back events.jsonl's loss curve, learning rates and evaluations, the resolved config
and metrics.json. The callback base alone (no training) is held by the per-tracker files."""
from __future__ import annotations

import io
import json

import pytest
import yaml

from rankwise.recipes.config import load_run_config
from rankwise.recipes.train import train

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

RUN = {
    "model": {"path": "tiny-llama", "task": "causal-lm"},
    "data": {"source": "stdlib-functions", "format": "prompt-completion", "max_length": 48,
             "limit": 64, "eval_fraction": 0.05},
    "method": {"name": "lora", "r": 4},
    "optim": {"name": "adamw", "lr": 0.01},
    "train": {"steps": 5, "batch_size": 4, "eval_every": 2, "eval_batch_size": 32, "log_every": 2,
              "progress": False, "log_to": ["tensorboard", {"name": "wandb", "tags": ["t"]}, "mlflow"]},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import os
    for name in ("WANDB_MODE", "MLFLOW_TRACKING_URI"):
        os.environ.pop(name, None)
    from rich.console import Console
    out = tmp_path_factory.mktemp("trackers") / "run"
    text = io.StringIO()
    metrics = train(load_run_config(None, base=json.loads(json.dumps(RUN))), out,
                    console=Console(file=text, width=400), summary=False)
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    return out, metrics, events, text.getvalue()


def curves(events):
    steps = [e for e in events if "loss" in e and "lr" in e]
    evals = [e for e in events if "eval_loss" in e]
    return {"train/loss": [(e["step"], e["loss"]) for e in steps],
            "train/lr": [(e["step"], e["lr"]) for e in steps],
            "eval/loss": [(e["step"], e["eval_loss"]) for e in evals],
            "eval/perplexity": [(e["step"], e["eval_perplexity"]) for e in evals]}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_each_tracker_reads_back_the_run(run, fed, name):
    out, metrics, events, _ = run
    got = fed.readers[name](out)
    want = curves(events)
    assert [s for s, _ in want["train/loss"]] == [2, 4, 5] and [s for s, _ in want["eval/loss"]] == [2, 4, 5]
    rel = 1e-6 if name == "tensorboard" else 0   # TensorBoard stores float32; the others float64
    for key, values in want.items():
        assert got["history"][key] == [(s, pytest.approx(v, rel=rel, abs=0)) for s, v in values], key
    assert got["config"] == yaml.safe_load((out / "config.yaml").read_text())
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    expect = numbers if name == "tensorboard" else metrics         # TensorBoard holds numbers only
    final = {k: got["final"][k] for k in expect}
    assert final == (pytest.approx(expect, rel=rel) if rel else expect)


@pytest.mark.slow
def test_one_line_per_tracker_says_where_it_writes(run):
    out, _, _, text = run
    lines = [x for x in text.splitlines() if x.split(":")[0] in ("tensorboard", "wandb", "mlflow")]
    assert [x.split(":")[0] for x in lines] == ["tensorboard", "wandb", "mlflow"]
    assert f"{out}/tensorboard" in lines[0] and f"{out}/wandb/offline-run-" in lines[1]
    assert (out / "mlruns").resolve().as_uri() in lines[2]
    assert "wandb:" not in text.replace(lines[1], "")            # W&B's own banner stays quiet
