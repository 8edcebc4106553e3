"""The seven mixture and prompt methods through ``rankwise train`` like any other method: they
train, log their auxiliary losses by name, write router statistics, save and load (rebuilt from
their own ``describe``), resume exactly, refuse a merged export with one line, and make valid
``compare`` rows; bad settings end with one line and exit 2."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.data.text import build_data
from rankwise.engine import evaluate, get_task
from rankwise.recipes.config import load_run_config
from rankwise.recipes.export import load_run
from rankwise.recipes.train import train
from test_cli_errors import assert_user_error, write_yaml

# small settings for the tiny models; everything else comes from the config dataclasses
METHODS = {
    "moe-lora": {"num_experts": 3, "top_k": 2, "r": 2, "targets": ["query", "value"]},
    "smore": {"experts": [3, 2], "ranks": [2, 2], "fanout": [2, 1], "gate_dims": [4, 4], "down_dim": 4,
              "targets": ["query", "value"]},
    "lope": {"r": 2, "num_experts": 2, "targets": ["query", "value"]},
    "fvae-lora": {"r": 2, "enc_hidden": 8, "dec_hidden": 8, "targets": ["query", "value"]},
    "prompt-tuning": {"num_virtual_tokens": 4},
    "pt-moe": {"num_virtual_tokens": 4, "num_experts": 3, "rank": 4},
    "capt": {},
}
AUX = {"moe-lora": {"balance_loss"}, "smore": {"balance_loss"},
       "fvae-lora": {"fvae_reconstruction", "fvae_kl_z1", "fvae_z2_prior", "fvae_z1_repulsion"}}
ROUTED = {"moe-lora", "smore", "lope", "pt-moe"}


@pytest.fixture(autouse=True)
def _data(docstrings_jsonl, monkeypatch):
    """The small stdlib-docstring file of conftest (about 70 records) as every run's data."""
    monkeypatch.setitem(DATA, "source", str(docstrings_jsonl))


DATA = {"source": "demo", "max_length": 20}


def raw_config(name: str, task: str = "classification", steps: int = 4) -> dict:
    model = "tiny-bert" if task == "classification" else "tiny-gpt2"
    return {"model": {"path": model, "task": task}, "data": dict(DATA),
            "method": {"name": name, **METHODS[name]},
            "optim": {"name": "adamw", "lr": 0.02},
            "train": {"steps": steps, "batch_size": 8, "eval_batch_size": 128, "save_every": 2,
                      "log_every": 1, "progress": False}}


def run(raw: dict, out: Path, resume: bool = False) -> dict:
    return train(load_run_config(None, base=json.loads(json.dumps(raw))), out, resume=resume)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_trains_logs_saves_resumes_and_refuses_merging(name, tmp_path):
    raw = raw_config(name)
    metrics = run(raw, tmp_path / "full")
    full = tmp_path / "full"
    steps = [json.loads(x) for x in (full / "events.jsonl").read_text().splitlines()]
    logged = {k for e in steps if "loss" in e for k in e}
    assert AUX.get(name, set()) <= logged                              # each aux loss by name
    stats = full / "router_stats.json"
    assert stats.is_file() == (name in ROUTED) and (full / "router_load.png").is_file() == (name in ROUTED)
    if name in ROUTED:
        layers = json.loads(stats.read_text())["layers"]
        for routers in layers.values():
            for s in routers.values():
                assert abs(sum(s["train"]["load"]) - 1.0) < 1e-5 and "eval" in s

    # save / load: the adapter rebuilt from its own describe reproduces the final evaluation
    cfg, model, tok = load_run(full)
    task = get_task("classification")
    _, eval_data = build_data(cfg.data, task, tok)                    # the same held-out split
    again = evaluate(model, task, eval_data, 128)
    assert abs(again["eval_loss"] - metrics["eval_loss"]) < 1e-5

    # resume from the step-2 checkpoint = uninterrupted
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step-0000004")
    (part / "metrics.json").unlink()
    resumed = run(raw, part, resume=True)
    assert resumed["eval_loss"] == metrics["eval_loss"]

    # a merged export ends with one line naming what to use
    res = CliRunner().invoke(main, ["export", str(full), "--format", "merged", "--out", str(tmp_path / "m")])
    assert_user_error(res, "cannot be merged", "--format rankwise")
    ok = CliRunner().invoke(main, ["export", str(full), "--format", "rankwise", "--out", str(tmp_path / "r")])
    assert ok.exit_code == 0, ok.output


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prompt-tuning", "capt", "pt-moe", "moe-lora"])
def test_causal_lm_trains_and_generates(name, tmp_path):
    raw = raw_config(name, task="causal-lm", steps=2)
    if "targets" in raw["method"]:
        raw["method"]["targets"] = ["c_attn"]                          # GPT-2's Conv1D
    metrics = run(raw, tmp_path / "run")
    assert metrics["eval_perplexity"] > 1.0
    res = CliRunner().invoke(main, ["generate", str(tmp_path / "run"), "--prompt", "Return the",
                                    "--max-new-tokens", "3"])
    assert res.exit_code == 0, res.output


@pytest.mark.slow
def test_prompt_tuning_exports_to_peft_with_the_same_logits(tmp_path):
    peft = pytest.importorskip("peft")
    run(raw_config("prompt-tuning"), tmp_path / "run")
    res = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--format", "peft", "--out",
                                    str(tmp_path / "peft")])
    assert res.exit_code == 0, res.output
    _, ours, tok = load_run(tmp_path / "run")
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "PROMPT_TUNING" and cfg["num_virtual_tokens"] == 4
    assert cfg["modules_to_save"] == ["classifier"]
    assert "PEFT: loads it; peft >= 0.14 (prompt tuning with a trained head" in res.output
    from rankwise.core.protocol import transform_inputs
    from rankwise.recipes.model import load_model
    base, _ = load_model("tiny-bert", "classification", num_labels=ours.config.num_labels, seed=0)
    theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    batch = dict(tok(["Return the difference of two sequences.", "Open a file."], padding=True,
                     return_tensors="pt"))
    batch.pop("token_type_ids", None)
    with torch.no_grad():
        torch.testing.assert_close(ours(**transform_inputs(ours, batch)).logits, theirs(**batch).logits,
                                   atol=1e-5, rtol=0)
    res = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--format", "merged", "--out",
                                    str(tmp_path / "m")])
    assert_user_error(res, "cannot be merged", "--format peft")


@pytest.mark.slow
@pytest.mark.parametrize("name, suggested", [("moe-lora", ["rankwise"]), ("lowrank", ["rankwise", "merged"])])
def test_peft_export_refusal_suggests_only_exports_that_work(name, suggested, tmp_path):
    """A non-LoRA adapter refuses ``--format peft`` naming the exports that work: ``merged`` only
    where the layers merge (it was suggested for routed layers, which then refused it)."""
    raw = raw_config("moe-lora", steps=1)
    if name == "lowrank":
        raw["method"] = {"name": "lowrank", "rank": 2, "targets": ["query", "value"]}
    run(raw, tmp_path / "run")
    res = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--format", "peft", "--out",
                                    str(tmp_path / "peft")])
    line = assert_user_error(res, "the PEFT LoRA format holds LoRA only")
    assert re.findall(r"--format (\w+)", line) == suggested and "(or merged)" not in line, line
    for fmt in suggested:                                               # each suggestion works
        ok = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--format", fmt, "--out",
                                       str(tmp_path / fmt)])
        assert ok.exit_code == 0, ok.output


@pytest.mark.slow
def test_every_new_method_is_a_compare_row(tmp_path):
    from rankwise.commands.compare.run import run_compare
    base = raw_config("moe-lora", steps=1)
    base["method"] = {"name": "lora", "r": 2, "targets": ["query", "value"]}
    base["compare"] = {name: {"method": {k: v for k, v in METHODS[name].items() if k != "targets"}}
                       for name in METHODS}
    result = run_compare(None, ["lora", *METHODS], 1, [], tmp_path / "cmp", base=base)
    assert set(result["rows"]) == {"lora", *METHODS}
    assert all(r["mean"]["trainable_params"] > 0 for r in result["rows"].values())


@pytest.mark.parametrize("name,sets,needles", [
    ("moe-lora", ["method.top_k=5", "method.num_experts=4"], ["top_k: got 5, more than num_experts=4"]),
    ("moe-lora", ["method.num_experts=0"], ["num_experts: got 0"]),
    ("smore", ["method.fanout=[5]", "method.experts=[4]", "method.ranks=[2]", "method.gate_dims=[4]"],
     ["picks 5 of 4 experts"]),
    ("pt-moe", ["method.top_k=9"], ["top_k: got 9, more than num_experts=3"]),
    ("prompt-tuning", ["method.num_virtual_tokens=0"], ["num_virtual_tokens: got 0"]),
    ("prompt-tuning", ["method.num_virtual_tokens=300"], ["300 virtual tokens leave no room", "128 positions"]),
])
def test_bad_settings_are_one_line(name, sets, needles, tmp_path):
    cfg = write_yaml(tmp_path / "run.yaml", raw_config(name))
    args = ["train", str(cfg), "--out", str(tmp_path / "run")]
    for item in sets:
        args += ["--set", item]
    assert_user_error(CliRunner().invoke(main, args), *needles)


def test_prompt_longer_than_the_positions_left_by_max_length(tmp_path):
    """Found at the first batch (the method does not know data.max_length): exit 2, the error
    is the last line and no checkpoint is written."""
    cfg = write_yaml(tmp_path / "run.yaml", raw_config("prompt-tuning"))
    res = CliRunner().invoke(main, ["train", str(cfg), "--out", str(tmp_path / "run"),
                                    "--set", "method.num_virtual_tokens=120"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    last = res.stderr.strip().splitlines()[-1]
    assert last == ("error: 120 virtual tokens + 20 tokens exceed the model's 128 positions; lower "
                    "data.max_length to 8 or method.num_virtual_tokens")
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
