"""``task: {name: grpo}`` through ``rankwise train``: it logs rewards and writes samples.jsonl,
resumes exactly (same samples, same adapter; a gain-rl run from mid-loop: the same sampler
state) and reports eval_reward_mean; bad input ends with one line and exit 2 (a reward that
cannot be imported, raises, or returns NaN naming the record; G < 2; data.order: gain-rl
without grpo)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rankwise.recipes.config import load_run_config
from rankwise.recipes.train import train
from test_cli_errors import assert_user_error, invoke, write_yaml


def raising_reward(prompts, completions, **columns):
    raise ValueError("boom")


def nan_reward(prompts, completions, **columns):
    return [float("nan") if r == 3 else 0.0 for r in columns["n"]]


def records(n: int) -> list[dict]:
    return [{"prompt": f"add {i} and {i + 1}\n", "answer": str(2 * i + 1), "n": i} for i in range(n)]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("prompts")
    train_file, eval_file = folder / "train.jsonl", folder / "eval.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in records(8)))
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in records(3)))
    return train_file, eval_file


def raw_config(files, steps: int = 2, **grpo) -> dict:
    return {"model": {"path": "tiny-llama", "task": "grpo"},
            "data": {"source": str(files[0]), "eval_source": str(files[1]), "max_length": 16},
            "method": {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"]},
            "optim": {"name": "adamw", "lr": 0.05},
            "grpo": {"rewards": ["exact-match", "length-penalty"], "num_generations": 3,
                     "max_completion_length": 4, **grpo},
            "train": {"steps": steps, "batch_size": 2, "eval_batch_size": 4, "save_every": 1,
                      "log_every": 1, "progress": False}}


def run(raw: dict, out: Path, resume: bool = False) -> dict:
    return train(load_run_config(None, base=json.loads(json.dumps(raw))), out, resume=resume)


@pytest.mark.slow
def test_grpo_run_logs_samples_resumes_exactly_and_reports_reward(prompts, tmp_path):
    raw = raw_config(prompts)
    full = tmp_path / "full"
    metrics = run(raw, full)
    lines = [json.loads(x) for x in (full / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1] * 6 + [2] * 6          # 2 prompts x G=3 per step
    for x in lines:
        assert x["reward"] == pytest.approx(x["rewards"]["exact-match"] + x["rewards"]["length-penalty"])
    steps = [json.loads(x) for x in (full / "events.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps[0]["reward"] == pytest.approx(sum(x["reward"] for x in lines[:6]) / 6, abs=1e-6)
    assert "eval_reward_mean" in metrics and metrics["eval_loss"] == -metrics["eval_reward_mean"]
    half = tmp_path / "half"  # resume from the step-1 checkpoint = uninterrupted
    shutil.copytree(full, half)
    shutil.rmtree(half / "checkpoints" / "step-0000002")
    (half / "metrics.json").unlink()
    resumed = run(raw, half, resume=True)
    assert (half / "samples.jsonl").read_text() == (full / "samples.jsonl").read_text()
    a, b = (load_file(str(p / "adapter" / "adapter.safetensors")) for p in (full, half))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["eval_reward_mean"] == metrics["eval_reward_mean"]
    res = invoke("export", full, "--format", "peft", "--out", tmp_path / "peft")
    assert res.exit_code == 0 and (tmp_path / "peft" / "adapter_config.json").is_file(), res.output


@pytest.mark.slow
def test_gain_rl_run_resumes_mid_loop_exactly(prompts, tmp_path):
    """data.order: gain-rl, a loop of 2 steps (pool 4, 2 prompts a step): resumed from the
    step-1 checkpoint (half a loop: its accuracy and online-angle sums in the sampler's state),
    the run draws the same prompts and ends with the same sampler state and adapter."""
    raw = raw_config(prompts, steps=3)
    raw["data"]["order"] = {"name": "gain-rl", "pool": 4, "move": 0.5}
    raw["train"]["keep_checkpoints"] = 3
    full = tmp_path / "full"
    run(raw, full)
    state = torch.load(full / "checkpoints" / "step-0000003" / "state.pt", weights_only=False)["schedule"]
    assert state["loop"] == 2 and state["ang"][1] == 2 * 3  # loop 2: step 3's 2 prompts x G=3 rows
    assert len(state["history"]) == 2                       # the centre moved once, after loop 1
    half = tmp_path / "half"
    shutil.copytree(full, half)
    for step in (2, 3):
        shutil.rmtree(half / "checkpoints" / f"step-000000{step}")
    assert [p.name for p in (half / "checkpoints").iterdir()] == ["step-0000001"]
    (half / "metrics.json").unlink()
    run(raw, half, resume=True)
    assert (half / "samples.jsonl").read_text() == (full / "samples.jsonl").read_text()
    again = torch.load(half / "checkpoints" / "step-0000003" / "state.pt", weights_only=False)["schedule"]
    assert again == state
    a, b = (load_file(str(p / "adapter" / "adapter.safetensors")) for p in (full, half))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_run_error(result, *needles: str) -> None:
    """Exit 2, no traceback, and the last stderr line the one ``error:`` line (the run had
    printed its parameter count before the first step)."""
    assert "Traceback" not in result.output and result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and sum(x.startswith("error") for x in lines) == 1
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])


@pytest.mark.parametrize("grpo, needles", [
    ({"rewards": ["no_such_module_xyz:f"]}, ["cannot import", "no_such_module_xyz:f"]),
    ({"rewards": ["test_grpo_run:raising_reward"]}, ["raising_reward", "raised ValueError: boom"]),
    ({"rewards": ["test_grpo_run:nan_reward"]}, ["nan_reward", "record 4", "finite"]),
    ({"num_generations": 1}, ["num_generations", ">= 2"]),
])
def test_bad_grpo_input_is_one_line(prompts, tmp_path, grpo, needles):
    cfg = write_yaml(tmp_path / "c.yaml", raw_config(prompts, steps=4, **grpo))
    assert_run_error(invoke("train", cfg, "--out", tmp_path / "run"), *needles)


def test_gain_rl_order_needs_grpo(tmp_path):
    raw = {"model": {"path": "tiny-llama", "task": "causal-lm"},
           "data": {"source": "stdlib-functions", "format": "prompt-completion", "order": "gain-rl"}}
    cfg = write_yaml(tmp_path / "c.yaml", raw)
    assert_user_error(invoke("train", cfg, "--out", tmp_path / "run"), "gain-rl", "task.name: grpo")
