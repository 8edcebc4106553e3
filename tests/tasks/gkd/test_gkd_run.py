"""``task: {name: gkd}`` through ``rankwise train`` on tiny models: the teacher ``tiny-llama``
fine-tuned on the records, saved in a temporary folder as a plain model (``export --format
merged``) or used as its finished run folder (the adapter merged on load; the same teacher). The
step metrics record where each micro-batch's completions came from, distillation lowers the
held-out divergence, and bad input ends with one line and exit 2 (a teacher that does not exist,
a teacher with another vocabulary, records without prompts, lmbda > 1)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rankwise.recipes.config import load_run_config
from rankwise.recipes.session import prepare
from rankwise.recipes.train import train
from test_cli_errors import assert_user_error, invoke, write_yaml


def records(n: int) -> list[dict]:
    return [{"prompt": f"def f{i}(x):\n", "completion": f"    return x * {i} + {i % 3}"} for i in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Training and evaluation records, and a model folder whose vocabulary is twice the
    student's (no tokenizer)."""
    from rankwise.recipes.model import load_tokenizer
    from rankwise.testing import tiny_llama64
    folder = tmp_path_factory.mktemp("gkd")
    out = {"train": folder / "train.jsonl", "eval": folder / "eval.jsonl", "wide": folder / "wide",
           "teacher": folder / "unused"}
    out["train"].write_text("".join(json.dumps(r) + "\n" for r in records(8)))
    out["eval"].write_text("".join(json.dumps(r) + "\n" for r in records(12)[8:]))
    tiny_llama64(vocab_size=2 * len(load_tokenizer("tiny-llama"))).save_pretrained(out["wide"])
    return out


@pytest.fixture(scope="module")
def teachers(files, tmp_path_factory) -> dict[str, Path]:
    """A teacher worth distilling: ``tiny-llama`` fine-tuned on the records (a 6-step LoRA run;
    the student starts from the same base), as its run folder and exported merged into a plain
    model folder (with the tokenizer) in a temporary folder."""
    folder = tmp_path_factory.mktemp("teachers")
    sft = raw_config(files, steps=6)
    sft["task"] = {"name": "causal-lm"}
    train(load_run_config(None, base=sft), folder / "run")
    result = invoke("export", folder / "run", "--format", "merged", "--out", folder / "model")
    assert result.exit_code == 0 and (folder / "model" / "config.json").is_file(), result.output
    return {"run": folder / "run", "folder": folder / "model"}


def raw_config(files, steps: int = 4, **task) -> dict:
    return {"model": {"path": "tiny-llama"},
            "task": {"name": "gkd", "teacher": str(files["teacher"]), "max_new_tokens": 6, **task},
            "data": {"source": str(files["train"]), "eval_source": str(files["eval"]),
                     "format": "prompt-completion", "max_length": 24},
            "method": {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"]},
            "optim": {"name": "adamw", "lr": 0.05},
            "train": {"steps": steps, "batch_size": 4, "eval_batch_size": 4, "save_every": steps,
                      "log_every": 1, "progress": False}}


def untrained(raw: dict) -> float:
    """The held-out divergence of the student before its first step."""
    session = prepare(load_run_config(None, base=json.loads(json.dumps(raw))), device="cpu")
    return session.engine().evaluate(session.eval_data, 4)["eval_loss"]


def run(raw: dict, out: Path) -> tuple[dict, list[dict]]:
    metrics = train(load_run_config(None, base=json.loads(json.dumps(raw))), out)
    steps = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if '"loss"' in x]
    return metrics, [s for s in steps if "on_policy" in s]


@pytest.mark.slow
def test_gkd_run_mixes_sources_and_lowers_the_divergence(files, teachers, tmp_path):
    """The teacher a model folder; lmbda 0.5 with seq_kd: each step's one micro-batch is the
    student's or the teacher's samples; 6 steps lower the held-out divergence by more than half."""
    raw = raw_config(files, steps=6, lmbda=0.5, seq_kd=True)
    raw["task"]["teacher"] = str(teachers["folder"])
    metrics, steps = run(raw, tmp_path / "run")
    assert len(steps) == 6
    assert {s["on_policy"] for s in steps} == {0.0, 1.0}                  # both sources drawn
    assert all(s["teacher_sampled"] == 1.0 - s["on_policy"] for s in steps)
    assert all(1.0 <= s["completion_length"] <= 6.0 for s in steps)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["task"]["teacher"] == str(teachers["folder"].resolve())
    before = untrained(raw)
    assert metrics["eval_loss"] < 0.5 * before, (metrics["eval_loss"], before)  # 0.0029 -> 0.0004


@pytest.mark.slow
def test_a_finished_run_is_a_teacher(files, teachers, tmp_path):
    """The teacher the run folder itself (its LoRA merged on load): the same teacher as the
    exported folder (the untrained student's divergence from both agrees to 1e-6); lmbda 1
    (TRL's ``DistillationTrainer``): every micro-batch on-policy."""
    raw = raw_config(files, steps=2, lmbda=1.0)
    raw["task"]["teacher"] = str(teachers["run"])
    folder = raw_config(files, steps=2, lmbda=1.0)
    folder["task"]["teacher"] = str(teachers["folder"])
    assert untrained(raw) == pytest.approx(untrained(folder), abs=1e-6) and untrained(raw) > 1e-3
    metrics, steps = run(raw, tmp_path / "run")
    assert [s["on_policy"] for s in steps] == [1.0, 1.0] and metrics["eval_loss"] > 0


def test_a_teacher_that_does_not_exist_is_one_line(files, tmp_path):
    raw = raw_config(files)
    raw["task"]["teacher"] = str(tmp_path / "no-such-teacher")
    cfg = write_yaml(tmp_path / "c.yaml", raw)
    assert_user_error(invoke("train", cfg, "--out", tmp_path / "run"), "task.teacher", "no-such-teacher",
                      "not found", "finished rankwise run folder")


@pytest.mark.parametrize("task, data, needles", [
    ({"lmbda": 1.5, "beta": -0.1}, {}, ["task.lmbda: got 1.5", "task.beta: got -0.1", "[0, 1]"]),
    ({}, {"format": "text"}, ["data.format: text has no prompts", "prompt-completion or chat"]),
    ({}, {"packing": True}, ["data.packing is not supported with task.name: gkd"]),
])
def test_bad_settings_are_one_line(files, tmp_path, task, data, needles):
    raw = raw_config(files, **task)
    raw["task"]["teacher"] = str(files["wide"])  # exists (the settings are checked before loading)
    raw["data"].update(data)
    cfg = write_yaml(tmp_path / "c.yaml", raw)
    assert_user_error(invoke("train", cfg, "--out", tmp_path / "run"), *needles)


def test_a_teacher_with_another_vocabulary_is_one_line(files, tmp_path):
    raw = raw_config(files)
    raw["task"]["teacher"] = str(files["wide"])
    cfg = write_yaml(tmp_path / "c.yaml", raw)
    result = invoke("train", cfg, "--out", tmp_path / "run")
    assert "Traceback" not in result.output and result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: task.teacher") and sum(x.startswith("error") for x in lines) == 1
    assert "has a vocabulary of" in lines[-1] and "shares the student's tokenizer" in lines[-1]


@pytest.mark.slow
@pytest.mark.integration
def test_two_processes_give_the_single_process_run(files, teachers, tmp_path):
    """torchrun, 2 gloo processes x 1 micro-batch against 1 process x 2 (grad_accum 2): each
    micro-batch draws its source and samples from a seed of (train.seed, step, its place among
    the step's micro-batches over all processes), and the loss divides by the step's completion
    tokens over both processes: the same step losses, adapter and eval_loss."""
    from safetensors.torch import load_file
    from tests.recipes.torchrun_helpers import losses, torchrun
    raw = raw_config(files, steps=2, lmbda=0.5, seq_kd=True)
    raw["task"]["teacher"] = str(teachers["folder"])
    raw["train"].update(batch_size=2, grad_accum=2, save_every=0)
    one = train(load_run_config(None, base=json.loads(json.dumps(raw))), tmp_path / "one")
    proc = torchrun(tmp_path, tmp_path / "two", "train.grad_accum=1", raw=raw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5, abs=1e-8)
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5, abs=1e-8)
    a, b = (load_file(str(tmp_path / p / "adapter" / "adapter.safetensors")) for p in ("one", "two"))
    assert sorted(a) == sorted(b) and all((a[k] - b[k]).abs().max() < 1e-6 for k in a)
    assert all(a[k].abs().max() > 0 for k in a if "lora_B" in k)    # the adapters moved (B starts at 0)
