"""``task: {name: simpo}`` through ``rankwise train``: the paper's loss (``cpo_alpha: 0``) is a
sum over pairs, so 2 micro-batches of 2 pairs (``grad_accum: 2``) give the steps of one batch of
4; the final ``eval_loss`` is eq. 6 of the saved adapter recomputed token by token; with TRL's
default ``cpo_alpha: 1`` the NLL is logged and added."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rankwise.recipes.config import load_run_config
from rankwise.recipes.export import load_run
from rankwise.recipes.train import train
from rankwise.tasks.pairs import build_pair_data
from tests.tasks.pair_fixtures import completion_by_hand, nll_by_hand

BETA, GAMMA = 2.0, 0.5


def raw_config(source: Path, cpo_alpha: float, accum: int = 1) -> dict:
    return {"model": {"path": "tiny-llama"},
            "task": {"name": "simpo", "beta": BETA, "gamma": GAMMA, "cpo_alpha": cpo_alpha},
            "data": {"source": str(source), "max_length": 32, "eval_fraction": 0.25},
            "method": {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"]},
            "optim": {"name": "adamw", "lr": 0.02},
            "train": {"steps": 3, "batch_size": 4, "grad_accum": accum, "eval_batch_size": 16,
                      "save_every": 0, "log_every": 1, "progress": False, "threads": 1}}


def step_lines(folder: Path) -> list[dict]:
    return [e for e in (json.loads(x) for x in (folder / "events.jsonl").read_text().splitlines()) if "loss" in e]


@pytest.mark.slow
def test_paper_simpo_accumulates_exactly_and_its_eval_loss_is_eq_6(pairs_jsonl, tmp_path):
    one = train(load_run_config(None, base=raw_config(pairs_jsonl, 0.0)), tmp_path / "one")
    two = train(load_run_config(None, base=raw_config(pairs_jsonl, 0.0, accum=2)), tmp_path / "two")
    a, b = step_lines(tmp_path / "one"), step_lines(tmp_path / "two")
    assert len(a) == 3 and "nll_loss" not in a[0]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
    assert one["eval_loss"] == pytest.approx(two["eval_loss"], rel=1e-5)

    cfg, model, tok = load_run(tmp_path / "one")
    _, evals = build_pair_data(cfg.data, tok)
    terms = []
    for i in range(len(evals)):
        (c, nc), (r, nr) = (completion_by_hand(model.eval(), evals[i], side) for side in ("chosen", "rejected"))
        z = BETA * c / nc - BETA * r / nr - GAMMA
        terms.append(math.log1p(math.exp(-z)))                     # -log sigma(z)
    assert one["eval_loss"] == pytest.approx(sum(terms) / len(terms), abs=1e-5)
    assert one["eval_reward_margin"] != 0.0


@pytest.mark.slow
def test_trl_default_adds_the_chosen_nll(pairs_jsonl, tmp_path):
    metrics = train(load_run_config(None, base=raw_config(pairs_jsonl, 1.0)), tmp_path / "run")
    lines = step_lines(tmp_path / "run")
    assert all("nll_loss" in e for e in lines)
    cfg, model, tok = load_run(tmp_path / "run")
    _, evals = build_pair_data(cfg.data, tok)
    nll = nll_by_hand(model.eval(), [evals[i] for i in range(len(evals))], on_prompt=False)
    assert metrics["eval_nll_loss"] == pytest.approx(nll, abs=1e-5)
    assert torch.isfinite(torch.tensor(metrics["eval_loss"])) and metrics["eval_loss"] > nll
