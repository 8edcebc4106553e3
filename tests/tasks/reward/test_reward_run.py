"""``task: {name: reward}`` through ``rankwise train``: its logged and evaluation metrics are
those of the saved model (recomputed here pair by pair, margins and centring included), it
resumes exactly, and its PEFT export (LoRA + the ``score`` head) and merged export load in PEFT /
transformers with the same scores; bad input ends with one line."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from rankwise.data.instruct import load_function_records
from rankwise.recipes.config import load_run_config
from rankwise.recipes.export import export_run, load_run
from rankwise.recipes.train import train
from rankwise.tasks.reward.task import RewardTask
from test_cli_errors import assert_user_error, invoke, write_yaml

CENTER = 0.05


def pair_records(n: int = 24, margins: bool = True) -> list[dict]:
    """Docstring -> its function's ``def`` line (chosen) or the next function's (rejected)."""
    recs = load_function_records()[:n + 1]
    out = [{"prompt": " ".join(a["prompt"].split()[:12]) + "\n", "chosen": a["completion"],
            "rejected": b["completion"]} for a, b in zip(recs, recs[1:])]
    if margins:
        for i, r in enumerate(out):
            r["margin"] = 0.25 * (i % 4)
    return out


def write_pairs(folder: Path, **kw) -> Path:
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in pair_records(**kw)))
    return path


def raw_config(source: Path, steps: int = 3, method: dict | None = None) -> dict:
    return {"model": {"path": "tiny-llama"},
            "task": {"name": "reward", "center_rewards_coefficient": CENTER},
            "data": {"source": str(source), "max_length": 32, "eval_fraction": 0.25},
            "method": method or {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"]},
            "optim": {"name": "adamw", "lr": 0.05},
            "train": {"steps": steps, "batch_size": 4, "eval_batch_size": 16, "save_every": 1,
                      "log_every": 1, "progress": False}}


def run(raw: dict, out: Path, resume: bool = False) -> dict:
    return train(load_run_config(None, base=json.loads(json.dumps(raw))), out, resume=resume)


def score(model, ids: list[int]) -> float:
    """One sequence alone (no padding): the head at its last token."""
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def hand_metrics(out: Path) -> dict[str, float]:
    """The evaluation metrics of run ``out``'s saved model, pair by pair, each sequence alone."""
    cfg, model, tok = load_run(out)
    _, evals = RewardTask(cfg.task).records(cfg.data, tok)
    center = cfg.task.center_rewards_coefficient
    losses, margins, rewards = [], [], []
    for pair in evals.pairs:
        rw, rl = score(model, pair["chosen_ids"]), score(model, pair["rejected_ids"])
        h = rw - rl - pair.get("margin", 0.0)
        losses.append(math.log1p(math.exp(-h)) + center * (rw + rl) ** 2)
        margins.append(rw - rl)
        rewards += [rw, rl]
    n = len(evals)
    return {"eval_loss": sum(losses) / n, "eval_margin": sum(margins) / n,
            "eval_accuracy": sum(m > 0 for m in margins) / n, "eval_mean_reward": sum(rewards) / (2 * n),
            "eval_min_reward": min(rewards), "eval_max_reward": max(rewards)}


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory) -> tuple[Path, dict, dict]:
    """A 3-step LoRA reward run on 24 pairs with margins and the centring term."""
    folder = tmp_path_factory.mktemp("reward")
    raw = raw_config(write_pairs(folder))
    return folder / "run", raw, run(raw, folder / "run")


@pytest.mark.slow
def test_reward_run_metrics_are_the_saved_models_and_it_resumes_exactly(reward_run, tmp_path):
    out, raw, metrics = reward_run
    logged = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    logged = [e for e in logged if "loss" in e]
    assert len(logged) == 3 and all({"accuracy", "margin", "mean_reward", "min_reward", "max_reward"} <= set(e)
                                    for e in logged)
    hand = hand_metrics(out)
    assert metrics["eval_margin"] != 0.0
    for key, value in hand.items():
        assert metrics[key] == pytest.approx(value, abs=1e-5), key

    part = tmp_path / "part"
    shutil.copytree(out, part)
    shutil.rmtree(part / "checkpoints" / "step-0000003")
    (part / "metrics.json").unlink()
    resumed = run(raw, part, resume=True)
    for key in ("eval_loss", "eval_accuracy", "eval_margin", "eval_mean_reward"):
        assert resumed[key] == metrics[key]


@pytest.mark.slow
def test_peft_and_merged_exports_load_with_the_same_scores(reward_run, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForSequenceClassification
    from rankwise.recipes.model import load_model
    out, _, _ = reward_run
    cfg, model, tok = load_run(out)
    seqs = [tok("def add(a, b):\n    return a + b")["input_ids"], tok("class Box: pass")["input_ids"]]
    want = [score(model, s) for s in seqs]
    export_run(out, "peft", tmp_path / "peft")
    export_run(out, "merged", tmp_path / "merged")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    base, _ = load_model(cfg.model.path, "reward", 1, seed=cfg.train.seed)
    assert abs(want[0] - score(base.eval(), seqs[0])) > 1e-4  # the adapter and head moved the score
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    merged = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "merged")).eval()
    assert merged.config.num_labels == 1
    for s, w in zip(seqs, want):
        assert score(loaded, s) == pytest.approx(w, abs=1e-5)
        assert score(merged, s) == pytest.approx(w, abs=1e-5)


@pytest.mark.slow
def test_bad_reward_input_ends_with_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    recs = pair_records()
    recs[3]["margin"] = None
    bad.write_text("".join(json.dumps(r) + "\n" for r in recs))
    raw = raw_config(bad, steps=1)
    res = invoke("train", write_yaml(tmp_path / "margin.yaml", raw), "--out", tmp_path / "o1")
    assert_user_error(res, "no numeric 'margin'")
    raw = raw_config(write_pairs(tmp_path), steps=1)
    raw["model"]["num_labels"] = 3
    res = invoke("train", write_yaml(tmp_path / "labels.yaml", raw), "--out", tmp_path / "o2")
    assert_user_error(res, "a reward model has one output")
