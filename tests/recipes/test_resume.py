"""The schedule of an extended run (:mod:`rankwise.recipes.resume`), against the engine's."""
from __future__ import annotations

import pytest
import torch

from rankwise.engine import linear_schedule
from rankwise.recipes.resume import dotted_diff, linear_factor, schedule_factor


def _engine_factors(steps: int, warmup_fraction: float) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = linear_schedule(opt, steps, warmup_fraction)
    out = []
    for _ in range(steps + 1):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("steps, warmup", [(4, 0.25), (12, 0.06), (200, 0.06), (7, 0.0)])
def test_linear_factor_is_the_engine_schedule(steps, warmup):
    assert [linear_factor(steps, warmup)(i) for i in range(steps + 1)] == pytest.approx(
        _engine_factors(steps, warmup), abs=1e-15)


def test_an_unchanged_run_keeps_its_schedule_and_a_second_change_chains():
    assert [schedule_factor(12, 0.25)(i) for i in range(13)] == [linear_factor(12, 0.25)(i) for i in range(13)]
    # 12 -> 40 at step 12 (w = 10), then 40 -> 60 at step 20, inside the first ramp
    f = schedule_factor(60, 0.25, [(12, 12), (40, 20)])
    first = schedule_factor(40, 0.25, [(12, 12)])
    assert [f(i) for i in range(20)] == [first(i) for i in range(20)]
    f20, w, new = first(20), 15, linear_factor(60, 0.25)
    assert f(20) == pytest.approx(f20 + (new(35) - f20) / w)
    assert [f(i) for i in range(35, 61)] == [new(i) for i in range(35, 61)]
    used = [f(i) for i in range(60)]
    assert max(abs(b - a) for a, b in zip(used[12:], used[13:])) <= 1 / 10 + 1e-12


def test_dotted_diff():
    saved = {"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "train": {"steps": 4}, "eval": {"samples": 0}}
    now = {"optim": {"lr": 0.2, "betas": [0.9, 0.99]}, "train": {"steps": 8}, "model": {"path": "x"}}
    assert dotted_diff(saved, now) == ["eval", "model", "optim.lr", "train.steps"]
