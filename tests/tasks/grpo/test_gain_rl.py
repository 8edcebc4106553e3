"""GAIN-RL's defining pieces: the ordering score on hidden states with known angles (both
readings), the hook on the last block's MLP, the sampler's centre update on the released
trainer's online angle (it holds at 0 % accuracy, moves by m tanh(2 ang) at 50 %), the online
angle of a GRPO training forward against a mean cosine by hand, and the task's own sampler."""
from __future__ import annotations

import math
import types

import pytest
import torch

from rankwise.engine.schedules import UniformOrderConfig
from rankwise.errors import RankwiseError
from rankwise.tasks.grpo.gain_rl import (GainRLSampler, angle_signal, centre_step, last_mlp, online_angle,
                                         prompt_signals, row_angles)
from rankwise.tasks.grpo.task import GainRLConfig, GRPOConfig, GRPOTask, rows_of
from rankwise.testing import tiny_llama_lm


def known_angles(prefix: int, question: int, theta: float, d: int = 16) -> torch.Tensor:
    """Prefix rows along e0; question row k = cos(theta) e0 + sin(theta) e_{k+1} (scaled: the
    signal normalises rows). Question pairs have cosine cos^2, question-prefix pairs cos."""
    rows = [3.0 * torch.eye(d)[0] for _ in range(prefix)]
    rows += [(math.cos(theta) * torch.eye(d)[0] + math.sin(theta) * torch.eye(d)[k + 1]) * (k + 1)
             for k in range(question)]
    return torch.stack(rows)


def test_pairs_reading_is_intra_plus_weighted_inter_on_known_angles():
    theta = math.pi / 3                                            # cos 0.5
    x = known_angles(prefix=3, question=5, theta=theta)
    assert angle_signal(x, prefix=3, inter_weight=8.0) == pytest.approx(0.25 + 8 * 0.5, abs=1e-6)
    # a tail of 2 tokens is left out: the same value; no prefix: the question term alone
    tail = torch.cat([x, torch.randn(2, 16)])
    assert angle_signal(tail, prefix=3, tail=2) == pytest.approx(4.25, abs=1e-6)
    assert angle_signal(x[3:], prefix=0) == pytest.approx(0.25, abs=1e-6)
    # tighter angles concentrate more
    assert angle_signal(known_angles(3, 5, 0.2), 3) > angle_signal(x, 3)


def test_released_reading_slices_rows_twice_and_averages_masked_zeros():
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    n = torch.nn.functional.normalize(x, dim=-1)
    m = (n @ n.T) * torch.tril(torch.ones(6, 6), diagonal=1)
    # prefix 1, tail 1: first slice = rows 1..4 (4 rows); then rows 1..2 of it (= rows 2, 3) and row 1
    expect = float(m[2:4].mean()) + 8 * float(m[1:2].mean())
    assert angle_signal(x, prefix=1, tail=1, reading="released") == pytest.approx(expect, abs=1e-6)


def test_signal_reads_the_input_of_the_last_blocks_mlp():
    model = tiny_llama_lm()
    assert last_mlp(model) is model.model.layers[-1].mlp
    seen = {}
    h = model.model.layers[-1].post_attention_layernorm.register_forward_hook(
        lambda mod, args, out: seen.setdefault("x", out.reshape(-1, out.shape[-1]).detach()))
    cfg = types.SimpleNamespace(prefix_tokens=1, tail_tokens=0, inter_weight=8.0, reading="pairs")
    ids = [5, 9, 3, 7, 2]
    (got,) = prompt_signals(model, [ids], cfg)
    h.remove()
    assert got == pytest.approx(angle_signal(seen["x"], 1, 0, 8.0), abs=1e-6)


def test_centre_update_formula():
    assert centre_step(0.0, 1.0, 0.0, 10.0) == pytest.approx(10 * math.tanh(1.0))
    assert centre_step(5.0, 0.0, 0.0, 10.0) == 5.0                 # never moves back
    assert centre_step(0.0, 1.0, 2.0, 10.0) == pytest.approx(10 * math.tanh(1.0) + 10 * math.tanh(4.0))
    assert centre_step(0.0, 2.0, 5.0, 10.0) <= 20.0                # at most 2 * move


def test_sampler_draws_around_its_centre_moves_it_and_resumes():
    n = 100
    scores = [(i * 37 % n) / n for i in range(n)]                  # a shuffled 0..0.99
    cfg = types.SimpleNamespace(pool=10, sigma=0.02, move=0.1, reward_max=2.0)
    s = GainRLSampler(scores, cfg, grad_accum=1, seed=3)
    first = s.draw(10)
    assert min(scores[i] for i in first) >= 0.85                   # the top of the order (sigma 2)
    s.observe([2.0, 2.0])                                          # accuracy 1 (reward_max 2)
    s.observe_angles([0.1, 0.3])                                   # the online angle: mean 0.2
    state = s.state_dict()
    second = s.draw(5)
    assert s.mu == pytest.approx(centre_step(0.0, 1.0, 0.2, 10.0))
    positions = [s.order.index(i) for i in second]
    assert abs(sum(positions) / 5 - s.mu) < 6                      # around the new centre
    again = GainRLSampler([0.0] * n, cfg, 1, 3)
    again.load_state_dict(state)
    assert again.draw(5) == second and again.mu == s.mu


def one_loop(acc: float, angle: float) -> GainRLSampler:
    """A sampler over 100 prompts whose ordering scores saturate tanh (4.25: cos^2 + 8 cos, the
    released x8 prefix term) after one loop of accuracy ``acc`` and online angle ``angle``."""
    cfg = types.SimpleNamespace(pool=10, sigma=0.1, move=0.1, reward_max=1.0)
    s = GainRLSampler([4.25 - i / 1000 for i in range(100)], cfg, grad_accum=1, seed=0)
    s.draw(10)
    s.observe([acc] * 4)
    for _ in range(5):
        s.observe_angles([angle, angle])
    s.draw(1)                                                      # a new loop: the centre moves
    return s


def test_centre_holds_at_zero_accuracy_with_a_constant_angle():
    # released: 10 (tanh(-1) + tanh(0.6)) = -2.25 -> clamped to 0; the fixed ordering score
    # (4.25) moved it by 10 (tanh(-1) + tanh(8.5)) = 2.38
    s = one_loop(acc=0.0, angle=0.3)
    assert s.mu == 0.0 and s.history == [0.0, 0.0]


def test_centre_moves_by_the_released_step_at_half_accuracy():
    # m = 0.1 * 100 = 10; 10 tanh(2 (0.5 - 0.5)) + 10 tanh(2 * 0.3) = 10 tanh(0.6) = 5.370496
    # (the ordering score 4.25 would give 10 tanh(8.5) = 10.0, 1.86x)
    assert one_loop(acc=0.5, angle=0.3).mu == pytest.approx(5.370496, abs=1e-6)


def test_online_angle_readings_on_known_cosines():
    theta = math.pi / 3
    x = known_angles(prefix=0, question=4, theta=theta)            # every pair: cos^2 = 0.25
    assert online_angle(x) == pytest.approx(0.25, abs=1e-6)
    # released: C * tril(1, 1) keeps 4 ones (diagonal), 3 super-diagonal and 6 lower entries of 0.25
    assert online_angle(x, "released") == pytest.approx((4 + 9 * 0.25) / 13, abs=1e-6)
    # rows: padding dropped; a prompt method's 2 leading virtual tokens left out
    h = torch.cat([torch.randn(2, 16), x, torch.randn(1, 16)])[None]   # (1, 2 + 4 + 1, 16)
    assert row_angles(h, torch.tensor([[1, 1, 1, 1, 0]])) == pytest.approx([0.25], abs=1e-6)


def test_online_angle_is_the_mean_cosine_of_the_training_forward():
    """GRPOTask.loss_sum with a sampler: one angle per row, the mean cosine over its distinct
    token pairs of the last block's MLP input (padding dropped), by hand."""
    model = tiny_llama_lm()
    model.train()
    task = GRPOTask(GRPOConfig(beta=0.0, num_generations=2))
    cfg = GainRLConfig(pool=4, sigma=0.1, move=0.1)
    task.sampler = GainRLSampler([0.0] * 4, cfg)
    batch = rows_of([[5, 9, 3], [7, 2]], [[4, 6], [8], [11, 12, 13], [3]], 2, pad=0)  # (4, 6)
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    seen = []
    h = model.model.layers[-1].post_attention_layernorm.register_forward_hook(
        lambda mod, args, out: seen.append(out.detach()))
    task.loss_sum(model, batch)
    h.remove()
    (x,) = seen                                                    # one forward: the policy's
    expect = []
    for r in range(4):
        rows = x[r][batch["attention_mask"][r].bool()]
        n = torch.nn.functional.normalize(rows, dim=-1)
        t = rows.shape[0]
        cos = [float(n[i] @ n[j]) for i in range(t) for j in range(i)]
        expect.append(sum(cos) / len(cos))
    assert task.sampler.ang_n == 4
    assert task.sampler.ang_sum / 4 == pytest.approx(sum(expect) / 4, abs=1e-6)
    assert len(set(round(e, 4) for e in expect)) == 4              # the rows differ


def test_the_task_builds_its_sampler_once():
    model = tiny_llama_lm()
    task = GRPOTask(GRPOConfig())
    run = types.SimpleNamespace(data=types.SimpleNamespace(order=GainRLConfig()),
                                train=types.SimpleNamespace(grad_accum=1, seed=0))
    data = types.SimpleNamespace(prompts=[[5, 9, 3], [7, 2], [4, 4, 4, 4]])
    s = task.schedule(run, model, data, "cpu")
    assert s is task.sampler and task.schedule(run, model, data, "cpu") is s
    assert s.scores == pytest.approx(prompt_signals(model, data.prompts, GainRLConfig()))
    assert s.order == sorted(range(3), key=lambda i: -s.scores[i])
    uniform = types.SimpleNamespace(data=types.SimpleNamespace(order=UniformOrderConfig()), train=run.train)
    assert GRPOTask(GRPOConfig()).schedule(uniform, model, data, "cpu") is None
    with pytest.raises(RankwiseError, match="without torchrun"):
        GRPOTask(GRPOConfig()).schedule(run, model, data, "cpu", distributed=True)
