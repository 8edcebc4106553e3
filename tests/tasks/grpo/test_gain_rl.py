"""GAIN-RL's defining pieces: the angle signal on hidden states with known angles (both
readings), the hook on the last block's MLP, the sampler's centre update and its draws."""
from __future__ import annotations

import math
import types

import pytest
import torch

from rankwise.tasks.grpo.gain_rl import GainRLSampler, angle_signal, centre_step, last_mlp, prompt_signals
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
    ang = sum(scores[i] for i in first) / 10
    state = s.state_dict()
    second = s.draw(5)
    assert s.mu == pytest.approx(centre_step(0.0, 1.0, ang, 10.0))
    positions = [s.order.index(i) for i in second]
    assert abs(sum(positions) / 5 - s.mu) < 6                      # around the new centre
    again = GainRLSampler([0.0] * n, cfg, 1, 3)
    again.load_state_dict(state)
    assert again.draw(5) == second
