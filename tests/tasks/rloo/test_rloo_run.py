"""``task: {name: rloo}`` through ``rankwise train``: samples.jsonl holds k completions per
prompt, each line's advantage is its group's leave-one-out advantage standardised over the step
(recomputed from the file's rewards), the run resumes exactly and reports eval_reward_mean; bad
input ends with one line and exit 2 (k < 2, a reversed reward_clip_range, data.order: gain-rl)."""
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

K = 3


def records(n: int) -> list[dict]:
    return [{"prompt": f"add {i} and {i + 1}\n", "answer": str(2 * i + 1)} for i in range(n)]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("prompts")
    train_file, eval_file = folder / "train.jsonl", folder / "eval.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in records(8)))
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in records(3)))
    return train_file, eval_file


def raw_config(files, steps: int = 2, **task) -> dict:
    return {"model": {"path": "tiny-llama"},
            "data": {"source": str(files[0]), "eval_source": str(files[1]), "max_length": 16},
            "method": {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"]},
            "optim": {"name": "adamw", "lr": 0.05},
            "task": {"name": "rloo", "rewards": ["exact-match", "length-penalty"], "num_generations": K,
                     "max_completion_length": 4, **task},
            "train": {"steps": steps, "batch_size": 2, "eval_batch_size": 4, "save_every": 1,
                      "log_every": 1, "progress": False}}


def run(raw: dict, out: Path, resume: bool = False) -> dict:
    return train(load_run_config(None, base=json.loads(json.dumps(raw))), out, resume=resume)


@pytest.mark.slow
def test_rloo_run_logs_leave_one_out_advantages_and_resumes_exactly(prompts, tmp_path):
    raw = raw_config(prompts, beta=0.0, normalize_advantages=True)
    full = tmp_path / "full"
    metrics = run(raw, full)
    lines = [json.loads(x) for x in (full / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1] * 6 + [2] * 6          # 2 prompts x k=3 per step
    for step in (1, 2):
        got = [x for x in lines if x["step"] == step]
        r = torch.tensor([x["reward"] for x in got])
        grouped = r.view(-1, K)                                       # (2, k)
        loo = (grouped - (grouped.sum(1, keepdim=True) - grouped) / (K - 1)).reshape(-1)
        expect = (loo - loo.mean()) / (loo.std() + 1e-4)
        assert torch.allclose(torch.tensor([x["advantage"] for x in got]), expect, atol=1e-5), step
        for x in got:
            assert x["reward"] == pytest.approx(x["rewards"]["exact-match"] + x["rewards"]["length-penalty"])
    assert float(torch.tensor([x["reward"] for x in lines]).std()) > 0     # the rewards differ
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


@pytest.mark.slow
def test_rloo_trains_dora_on_an_nf4_base(prompts, tmp_path):
    """QLoRA: the rollout samples from, and the reference disables the adapters of, a 4-bit base
    (bf16 compute) with DoRA; the KL penalty is logged and the adapter moves."""
    pytest.importorskip("bitsandbytes")
    raw = raw_config(prompts, steps=2)
    raw["model"].update(quantize="nf4", dtype="bfloat16")
    raw["method"].update(use_dora=True)
    raw["train"].update(precision="bf16", save_every=0)
    metrics = run(raw, tmp_path / "q")
    events = [json.loads(x) for x in (tmp_path / "q" / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if "loss" in e]
    assert len(steps) == 2 and all(abs(e["loss"]) < 1e-2 and "kl" in e for e in steps)  # loss 0 in value
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6) and steps[1]["kl"] != 0.0   # B starts at 0
    adapter = load_file(str(tmp_path / "q" / "adapter" / "adapter.safetensors"))
    assert any("lora_B" in k and adapter[k].abs().max() > 0 for k in adapter)
    assert "eval_reward_mean" in metrics


@pytest.mark.integration
@pytest.mark.slow
def test_two_processes_normalise_over_the_whole_step(prompts, tmp_path):
    """Two gloo processes x 1 micro-batch = one process x ``grad_accum: 2``: the same groups are
    sampled (GRPO's seeding), and ``normalize_advantages`` spans both processes' micro-batches
    (an all-reduce), so the step losses, the adapter and ``eval_reward_mean`` agree; beta > 0
    (the KL penalty in the reward)."""
    from tests.recipes.torchrun_helpers import losses, torchrun
    raw = raw_config(prompts, normalize_advantages=True, beta=0.1)
    raw["train"].update(batch_size=4, grad_accum=2, save_every=0)   # 4 prompts x k=3 per step
    one = run(raw, tmp_path / "one")
    proc = torchrun(tmp_path, tmp_path / "two", "train.grad_accum=1", raw=raw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two["eval_reward_mean"] == pytest.approx(one["eval_reward_mean"], rel=1e-6, abs=1e-6)
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5, abs=1e-7)
    a, b = (load_file(str(tmp_path / p / "adapter" / "adapter.safetensors")) for p in ("one", "two"))
    assert sorted(a) == sorted(b) and all((a[k] - b[k]).abs().max() < 1e-6 for k in a)
    assert all(a[k].abs().max() > 0 for k in a if "lora_B" in k)    # the adapters moved (B starts at 0)
    # the logged step-1 advantages are standardised over both micro-batches (12 completions),
    # not over each
    lines = [json.loads(x) for x in (tmp_path / "one" / "samples.jsonl").read_text().splitlines()]
    first = torch.tensor([x["advantage"] for x in lines if x["step"] == 1])
    assert len(first) == 12 and abs(float(first.mean())) < 1e-5
    assert float(first.std()) == pytest.approx(1.0, abs=0.01)        # std / (std + 1e-4), rewards ~0.05 apart
    assert abs(float(first[:6].std()) - 1.0) > 0.05                  # micro-batch 1 alone is not std 1


@pytest.mark.parametrize("task, data, needles", [
    ({"num_generations": 1}, {}, ["num_generations: got 1", "other k - 1", ">= 2"]),
    ({"reward_clip_range": [1.0, 0.0]}, {}, ["reward_clip_range", "low <= high"]),
    ({}, {"order": "gain-rl"}, ["gain-rl", "task.name: grpo", "got rloo"]),
])
def test_bad_rloo_input_is_one_line(prompts, tmp_path, task, data, needles):
    raw = raw_config(prompts, **task)
    raw["data"].update(data)
    cfg = write_yaml(tmp_path / "c.yaml", raw)
    assert_user_error(invoke("train", cfg, "--out", tmp_path / "run"), *needles)
