"""``task: {name: dpo}`` through ``rankwise train``: it logs rewards and log-probs, its
``eval_reward_margin`` / ``eval_reward_accuracy`` are those of the saved adapter against the base
(recomputed here by hand), it resumes exactly and exports; full fine-tuning precomputes the
reference of the initial weights; bad pairs are dropped and counted, or refused with one line."""
from __future__ import annotations

import json
import math
import shutil
import signal
from pathlib import Path

import pytest
import torch

from rankwise.core.ops import disable_adapters
from rankwise.engine import get_task
from rankwise.tasks.dpo.task import completion_logps
from rankwise.tasks.pairs import build_pair_data
from rankwise.recipes.config import load_run_config
from rankwise.recipes.export import load_run
from rankwise.recipes.model import load_tokenizer
from rankwise.recipes.train import train
from rankwise.recipes.session import prepare
from test_cli_errors import assert_user_error, invoke, write_yaml
from tests.recipes.test_train import start_and_wait_for_checkpoint
from tests.tasks.pair_fixtures import CHAT_TEMPLATE as TEMPLATE, pair_records


def raw_config(source: Path, method: str = "lora", steps: int = 2) -> dict:
    m = {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"]} if method == "lora" else {"name": method}
    return {"model": {"path": "tiny-llama", "task": "dpo"},
            "data": {"source": str(source), "max_length": 32, "eval_fraction": 0.25},
            "method": m, "optim": {"name": "adamw", "lr": 0.02},
            "dpo": {"beta": 0.2},
            "train": {"steps": steps, "batch_size": 4, "eval_batch_size": 16, "save_every": 1,
                      "log_every": 1, "progress": False}}


def run(raw: dict, out: Path, resume: bool = False) -> dict:
    return train(load_run_config(None, base=json.loads(json.dumps(raw))), out, resume=resume)


@pytest.mark.slow
def test_lora_dpo_logs_rewards_matches_a_hand_count_resumes_and_exports(pairs_jsonl, tmp_path):
    raw = raw_config(pairs_jsonl)
    full = tmp_path / "full"
    metrics = run(raw, full)
    steps = [json.loads(x) for x in (full / "events.jsonl").read_text().splitlines()]
    logged = [e for e in steps if "loss" in e]
    assert len(logged) == 2 and all({"reward_margin", "reward_accuracy", "logps_chosen",
                                     "logps_rejected"} <= set(e) for e in logged)
    assert logged[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # LoRA B = 0: policy = reference
    assert logged[0]["reward_margin"] == 0.0

    # the saved adapter against the base, summed by hand over the evaluation pairs
    cfg, model, tok = load_run(full)
    _, evals = build_pair_data(cfg.data, tok)
    margins = []
    with torch.no_grad():
        for i in range(len(evals)):
            ex, lp = evals[i], {}
            for side in ("chosen", "rejected"):
                ids, labels = (torch.tensor([ex[f"{side}_{k}"]]) for k in ("ids", "labels"))
                pol = float(completion_logps(model(input_ids=ids).logits, labels)[0])
                with disable_adapters(model):
                    ref = float(completion_logps(model(input_ids=ids).logits, labels)[0])
                lp[side] = 0.2 * (pol - ref)
            margins.append(lp["chosen"] - lp["rejected"])
    assert metrics["eval_reward_margin"] == pytest.approx(sum(margins) / len(margins), abs=1e-5)
    assert metrics["eval_reward_accuracy"] == pytest.approx(sum(m > 0 for m in margins) / len(margins))
    assert metrics["eval_reward_margin"] != 0.0
    assert metrics["eval_loss"] == pytest.approx(
        sum(-math.log(1 / (1 + math.exp(-m))) for m in margins) / len(margins), abs=1e-5)

    # resume from the step-1 checkpoint = uninterrupted
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step-0000002")
    (part / "metrics.json").unlink()
    resumed = run(raw, part, resume=True)
    for key in ("eval_loss", "eval_reward_margin", "eval_reward_accuracy"):
        assert resumed[key] == metrics[key]

    res = invoke("export", full, "--format", "peft", "--out", tmp_path / "peft")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "peft" / "adapter_config.json").is_file()


def grpo_raw(tmp_path: Path, steps: int) -> dict:
    """The tiny GRPO run of test_grpo_run (2 prompts x G=3, 4-token completions)."""
    from tests.tasks.grpo.test_grpo_run import raw_config as grpo_config, records
    files = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    for f, n in zip(files, (8, 3)):
        f.write_text("".join(json.dumps(r) + "\n" for r in records(n)))
    return grpo_config(files, steps=steps)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("task", ["dpo", "grpo"])
def test_sigkill_then_resume_equals_uninterrupted(pairs_jsonl, tmp_path, task):
    """``kill -9`` after the step-1 checkpoint of a 4-step run, then ``--resume``: the same
    step losses, rewards and final metrics, bit for bit, as the run nobody stopped (one torch
    thread on both sides, so the sums are taken in the same order). GRPO also samples its
    completions again after the resume: the same samples.jsonl, so the sampling RNG came back."""
    raw = raw_config(pairs_jsonl, steps=4) if task == "dpo" else grpo_raw(tmp_path, steps=4)
    raw["train"].update(save_every=1, eval_every=0, threads=1)
    raw["method"]["dropout"] = 0.1                      # an RNG stream the resume must restore
    raw[task]["disable_dropout"] = False                # (on by default, it would zero that dropout)
    ref = run(raw, tmp_path / "ref")
    cfg = write_yaml(tmp_path / "c.yaml", raw)
    out = tmp_path / "killed"
    proc = start_and_wait_for_checkpoint(cfg, out, step=1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "metrics.json").exists(), "the run finished before the kill"
    resumed = run(raw, out, resume=True)
    keys = ("eval_reward_margin", "eval_reward_accuracy") if task == "dpo" else ("eval_reward_mean",)
    keys = ("eval_loss", *keys)
    for key in keys + ("steps",):
        assert resumed[key] == ref[key], key
    reward = "reward_margin" if task == "dpo" else "reward"

    def steps(folder: Path) -> list[dict]:
        lines = [json.loads(x) for x in (folder / "events.jsonl").read_text().splitlines()]
        return [{k: e[k] for k in ("step", "loss", reward)} for e in lines if "loss" in e]
    assert steps(out) == steps(tmp_path / "ref") and len(steps(out)) == 4
    if task == "grpo":
        assert (out / "samples.jsonl").read_text() == (tmp_path / "ref" / "samples.jsonl").read_text()


@pytest.mark.slow
def test_full_fine_tuning_precomputes_the_reference_of_the_initial_weights(pairs_jsonl):
    cfg = load_run_config(None, base=raw_config(pairs_jsonl, method="full", steps=2))
    session = prepare(cfg, device="cpu")
    ref = session.train_data.ref_logps
    assert ref is not None and len(ref) == len(session.train_data)
    ex = session.train_data[0]
    with torch.no_grad():
        ids, labels = torch.tensor([ex["chosen_ids"]]), torch.tensor([ex["chosen_labels"]])
        logp = float(completion_logps(session.model.eval()(input_ids=ids).logits, labels)[0])
    assert ref[0][0] == pytest.approx(logp, abs=1e-5)
    engine = session.engine()
    assert engine.train_step(0).loss == pytest.approx(math.log(2), abs=1e-6)  # policy = reference
    assert engine.train_step(1).loss != pytest.approx(math.log(2), abs=1e-4)


def test_bad_pairs_are_dropped_and_counted(tmp_path):
    recs = pair_records(24)
    recs[0]["rejected"] = recs[0]["chosen"]
    del recs[1]["chosen"]
    recs[2]["prompt"] = ""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = load_run_config(None, base=raw_config(path))
    with pytest.warns(UserWarning, match=r"dropped 3 of 24 records \(2 lack a prompt, chosen or rejected; 1 have"):
        train_data, evals = build_pair_data(cfg.data, load_tokenizer("tiny-llama"))
    assert len(train_data) + len(evals) + train_data.dropped + evals.dropped == 21
    ex = train_data[0]
    prompt = sum(1 for v in ex["chosen_labels"] if v == -100)
    assert ex["chosen_ids"][:prompt] == ex["rejected_ids"][:prompt] and prompt > 1
    assert ex["chosen_labels"][prompt:] == ex["chosen_ids"][prompt:]      # completion + EOS


@pytest.mark.parametrize("case", ["all-same", "all-empty", "no-column", "classification-model", "section"])
def test_bad_input_is_one_line(case, tmp_path):
    recs = pair_records(24)
    if case == "all-same":
        recs = [dict(r, rejected=r["chosen"]) for r in recs]
    if case == "all-empty":                                   # the column is there, no value is
        recs = [dict(r, rejected="") for r in recs]
    if case == "no-column":
        recs = [{"prompt": r["prompt"], "good": r["chosen"], "rejected": r["rejected"]} for r in recs]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    raw = raw_config(path)
    if case == "classification-model":
        raw["model"]["path"] = "tiny-bert"
    if case == "section":
        raw["model"]["task"] = "causal-lm"
    res = invoke("train", write_yaml(tmp_path / "c.yaml", raw), "--out", tmp_path / "run")
    needles = {"all-same": ("none of its 24 records", "0 lack a prompt, chosen or rejected; 24 have chosen == rejected"),
               "all-empty": ("none of its 24 records", "24 lack a prompt, chosen or rejected; 0 have"),
               "no-column": ("no 'chosen' field", "data.chosen_field"),
               "classification-model": ("cannot be a causal LM",),
               "section": ("dpo section needs model.task: dpo",)}[case]
    assert_user_error(res, *needles)


def test_dpo_section_defaults_are_recorded():
    cfg = load_run_config(None, base={"model": {"path": "tiny-llama"}, "task": {"name": "dpo"}})
    assert cfg.to_dict()["task"] == {"name": "dpo", "loss": "sigmoid", "loss_weights": None, "beta": 0.1,
                                     "label_smoothing": 0.0, "discopop_tau": 0.05, "reference": "auto",
                                     "disable_dropout": True}
    assert get_task(cfg.task).config is cfg.task
    old = load_run_config(None, base={"model": {"path": "tiny-llama", "task": "dpo"}})  # old spelling
    assert old.to_dict() == cfg.to_dict()


def test_chat_pairs_share_the_prompt_and_label_only_the_answer(tmp_path):
    recs = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"name {i}"}],
             "chosen": [{"role": "assistant", "content": f"the number {i}"}], "rejected": "no"}
            for i in range(8)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    raw = raw_config(path)
    raw["data"].update({"format": "chat", "chat_template": TEMPLATE, "eval_fraction": 0.5})
    cfg = load_run_config(None, base=raw)
    tok = load_tokenizer("tiny-llama")
    train_data, _ = build_pair_data(cfg.data, tok)
    ex = train_data[0]
    k = sum(1 for v in ex["chosen_labels"] if v == -100)
    assert ex["chosen_ids"][:k] == ex["rejected_ids"][:k]
    assert tok.decode(ex["chosen_ids"][:k]).endswith("< assistant >")        # generation prompt
    assert tok.decode([t for t in ex["rejected_labels"] if t != -100]) == "no [SEP]"
