"""``task: {name: orpo}`` through ``rankwise train``: each step logs the NLL, the log-odds and
the rewards; the final ``eval_loss`` / ``eval_nll_loss`` / ``eval_log_odds_chosen`` are those of
the saved adapter recomputed token by token; the adapter exports for PEFT; a full fine-tune
needs no reference (nothing precomputed)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rankwise.recipes.config import load_run_config
from rankwise.recipes.export import load_run
from rankwise.recipes.session import prepare
from rankwise.recipes.train import train
from rankwise.tasks.pairs import build_pair_data
from test_cli_errors import invoke
from tests.tasks.pair_fixtures import completion_by_hand, nll_by_hand


def raw_config(source: Path, method: str = "lora", steps: int = 2) -> dict:
    m = {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"]} if method == "lora" else {"name": method}
    return {"model": {"path": "tiny-llama"}, "task": {"name": "orpo", "beta": 0.5},
            "data": {"source": str(source), "max_length": 32, "eval_fraction": 0.25},
            "method": m, "optim": {"name": "adamw", "lr": 0.02},
            "train": {"steps": steps, "batch_size": 4, "eval_batch_size": 16, "save_every": 1,
                      "log_every": 1, "progress": False}}


def by_hand(model, evals, beta: float) -> dict:
    """ORPO's evaluation metrics over ``evals`` from per-token log-probs (eq. 6-7)."""
    items = [evals[i] for i in range(len(evals))]
    terms, odds = [], []
    for it in items:
        (c, nc), (r, nr) = (completion_by_hand(model, it, side) for side in ("chosen", "rejected"))
        c, r = c / nc, r / nr
        h = (c - math.log(-math.expm1(c))) - (r - math.log(-math.expm1(r)))
        odds.append(h)
        terms.append(-beta * -math.log1p(math.exp(-h)))          # -beta * log sigma(h)
    nll = nll_by_hand(model, items, on_prompt=True)
    return {"eval_loss": sum(terms) / len(terms) + nll, "eval_nll_loss": nll,
            "eval_log_odds_chosen": sum(odds) / len(odds)}


@pytest.mark.slow
def test_lora_orpo_logs_its_terms_matches_a_hand_count_and_exports(pairs_jsonl, tmp_path):
    out = tmp_path / "run"
    metrics = train(load_run_config(None, base=raw_config(pairs_jsonl)), out)
    steps = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    logged = [e for e in steps if "loss" in e]
    assert len(logged) == 2 and all({"nll_loss", "log_odds_ratio", "log_odds_chosen", "reward_margin",
                                     "reward_accuracy"} <= set(e) for e in logged)
    first = logged[0]                                             # loss = NLL + lambda * L_OR
    assert first["loss"] == pytest.approx(first["nll_loss"] - 0.5 * first["log_odds_ratio"], rel=1e-5)

    cfg, model, tok = load_run(out)
    _, evals = build_pair_data(cfg.data, tok)
    expect = by_hand(model.eval(), evals, beta=0.5)
    for key, value in expect.items():
        assert metrics[key] == pytest.approx(value, abs=1e-5), key

    res = invoke("export", out, "--format", "peft", "--out", tmp_path / "peft")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "peft" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_full_fine_tuning_needs_no_reference(pairs_jsonl):
    session = prepare(load_run_config(None, base=raw_config(pairs_jsonl, method="full")), device="cpu")
    assert session.train_data.ref_logps is None and getattr(session.task, "snapshot", None) is None
    engine = session.engine()
    losses = [engine.train_step(k).loss for k in range(2)]
    assert all(math.isfinite(x) for x in losses) and losses[1] < losses[0]
    assert all(p.requires_grad for p in session.model.parameters())
    assert torch.isfinite(torch.tensor(engine.evaluate(session.eval_data, 16)["eval_loss"]))


def step_losses(folder: Path) -> list[float]:
    return [e["loss"] for e in map(json.loads, (folder / "events.jsonl").read_text().splitlines()) if "loss" in e]


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_steps(pairs_jsonl, tmp_path):
    raw = raw_config(pairs_jsonl, steps=3)
    plain = train(load_run_config(None, base=raw), tmp_path / "plain")
    raw["train"]["gradient_checkpointing"] = True
    ckpt = train(load_run_config(None, base=json.loads(json.dumps(raw))), tmp_path / "ckpt")
    assert step_losses(tmp_path / "ckpt") == pytest.approx(step_losses(tmp_path / "plain"), rel=1e-6)
    assert ckpt["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)


@pytest.mark.integration
@pytest.mark.slow
def test_two_processes_give_one_process_with_two_micro_batches(pairs_jsonl, tmp_path):
    """ORPO's NLL is a token mean per micro-batch (TRL's), so 2 gloo processes x 1 micro-batch of 4
    pairs equal 1 process x 2 micro-batches of 4 (``grad_accum: 2``): the step losses and the
    evaluation metrics (every process evaluates the whole set)."""
    from tests.recipes.torchrun_helpers import torchrun
    raw = raw_config(pairs_jsonl, steps=3)
    raw["train"].update(batch_size=8, grad_accum=2, save_every=0)
    one = train(load_run_config(None, base=json.loads(json.dumps(raw))), tmp_path / "one")
    proc = torchrun(tmp_path, tmp_path / "two", "train.grad_accum=1", raw=raw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    for key in ("eval_loss", "eval_nll_loss", "eval_log_odds_chosen", "eval_reward_margin"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-5), key
    assert step_losses(tmp_path / "two") == pytest.approx(step_losses(tmp_path / "one"), rel=1e-5)
