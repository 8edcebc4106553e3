"""Instruction-tuning runs end to end: eval loss over completion tokens only, samples at every
evaluation, the data line and the dropped count, TensorBoard, and bad input through the CLI."""
from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch.nn import functional as F

from rankwise.cli import main
from rankwise.data.formats import IGNORE
from rankwise.recipes.config import load_run_config
from rankwise.commands.generate.run import load_for_generation
from rankwise.recipes.train import train

RUN = {
    "model": {"path": "tiny-llama", "task": "causal-lm"},
    "data": {"source": "stdlib-functions", "format": "prompt-completion", "max_length": 48,
             "limit": 96, "packing": True, "eval_fraction": 0.05},   # ~70 held-out records, not ~290
    "method": {"name": "lora", "r": 4},
    "optim": {"name": "adamw", "lr": 0.01},
    "train": {"steps": 6, "batch_size": 8, "eval_every": 3, "eval_batch_size": 32, "progress": False},
}


def config(**sections):
    raw = json.loads(json.dumps(RUN))
    for name, over in sections.items():
        raw.setdefault(name, {}).update(over)
    return load_run_config(None, base=raw)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("instruct") / "run"
    metrics = train(config(eval={"samples": 3, "max_new_tokens": 4}, train={"log_to": ["tensorboard"]}), out)
    return out, metrics


@pytest.mark.slow
def test_eval_loss_is_the_mean_over_completion_tokens(run):
    out, metrics = run
    cfg, model, tok, _ = load_for_generation(out)
    from rankwise.data.text import build_data
    from rankwise.engine import get_task
    _, evals = build_data(cfg.data, get_task("causal-lm"), tok)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(evals)):
            ex = evals[i]
            logits = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0]   # (T, V)
            labels = torch.tensor(ex["labels"])
            keep = labels[1:] != IGNORE                                           # completion + EOS
            total += float(F.cross_entropy(logits[:-1][keep], labels[1:][keep], reduction="sum"))
            count += int(keep.sum())
    assert count < sum(len(evals[i]["input_ids"]) - 1 for i in range(len(evals)))  # prompts excluded
    assert metrics["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)


@pytest.mark.slow
def test_samples_at_every_evaluation_and_the_data_report(run):
    out, metrics = run
    lines = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [(x["step"], x["index"]) for x in lines] == [(s, k) for s in (3, 6) for k in range(3)]
    assert all(x["prompt"] and x["reference"].startswith("def ") for x in lines)
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    data = [e for e in events if e.get("event") == "data"]
    assert len(data) == 1 and data[0]["train_examples"] == metrics["train_examples"]
    assert data[0]["dropped_too_long"] == metrics["dropped_too_long"] > 0     # long def lines at 48
    assert 0 < metrics["packing_efficiency"] <= 1 and metrics["packed_blocks"] < metrics["train_examples"]


@pytest.mark.slow
def test_samples_do_not_change_training(run, tmp_path):
    _, with_samples = run
    plain = train(config(), tmp_path / "plain")
    assert plain["eval_loss"] == with_samples["eval_loss"]


@pytest.mark.slow
def test_tensorboard_has_train_and_eval_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, metrics = run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/loss", "eval/perplexity"} <= tags
    final = acc.Scalars("eval/loss")[-1]
    assert final.step == 6 and final.value == pytest.approx(metrics["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("sets, match", [
    (["data.format=chat", "data.source=stdlib-functions"], "data.chat_template"),
    (["model.task=classification", "data.source=demo", "data.format=text"], "data.packing needs task.name"),
    (["data.messages_field=msgs", "data.format=chat", "data.chat_template='{{ x }}'"], "no 'msgs' field in any record"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, match):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(RUN))
    result = CliRunner().invoke(main, ["train", str(cfg), "--out", str(tmp_path / "out"),
                                       *[x for s in sets for x in ("--set", s)]])
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and match in lines[0], result.output
    assert not (tmp_path / "out" / "config.yaml").exists()
