"""NanoAdam: a gradient-free mask of each tensor's smallest weights; entries outside it are
bit-identical after training; AdamW parity at density 1 across mask recomputations; moments kept
for entries that stay selected; state held for the selected entries only."""
import math

import pytest
import torch

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.errors import RankwiseError
from rankwise.optim.common import state_bytes
from rankwise.optim.nanoadam import (NanoAdam, NanoAdamConfig, build_nanoadam, nanoadam_param_groups,
                                     nanoadam_state_floats, scheduled_density, smallest_indices)
from rankwise.testing import tiny_batch, tiny_llama_lm


def _train(model, opt, steps):
    model.train()
    for s in range(steps):
        opt.zero_grad()
        model(**tiny_batch("llama", seed=s)).loss.backward()
        opt.step()


def test_weights_outside_every_mask_are_bit_identical():
    model = tiny_llama_lm()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = NanoAdamConfig(lr=1e-2, density=0.2, mask_interval=3)
    opt = build_nanoadam(model, cfg)
    masked = {id(p) for g in opt.param_groups if g["masked"] for p in g["params"]}
    selected = {id(p): torch.zeros(p.numel(), dtype=torch.bool) for g in opt.param_groups
                if g["masked"] for p in g["params"]}
    for s in range(7):                                   # new masks at steps 1, 4, 7
        opt.zero_grad()
        model(**tiny_batch("llama", seed=s)).loss.backward()
        opt.step()
        for p in model.parameters():
            if id(p) in selected:
                selected[id(p)][opt.state[p]["index"].long()] = True
    checked = 0
    for n, p in model.named_parameters():
        if id(p) not in masked:
            continue
        never = ~selected[id(p)]
        assert torch.equal(p.detach().flatten()[never], before[n].flatten()[never]), n   # bit for bit
        assert not torch.equal(p.detach(), before[n]), n                                  # the rest moved
        assert 0.2 <= selected[id(p)].float().mean() < 0.6                              # 1 to 3 masks' worth
        checked += 1
    assert checked == 15   # the embedding and the 14 block matrices


def test_param_groups_mask_matrices_but_not_heads_or_vectors():
    model = tiny_llama_lm()
    groups = nanoadam_param_groups(model, NanoAdamConfig())
    masked = {id(p) for g in groups if g.get("masked") for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in masked}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert all(model.get_parameter(n).ndim == 2 for n in names) and len(names) == 15


def test_mask_is_the_smallest_weights_and_ignores_the_gradient():
    w = torch.nn.Parameter(torch.tensor([[0.5, -0.01, 2.0], [0.03, -0.7, 0.002]]))
    assert smallest_indices(w, 3).tolist() == [1, 3, 5]
    picks = []
    for grad in (torch.ones(2, 3), -5 * torch.rand(2, 3)):
        p = torch.nn.Parameter(w.detach().clone())
        opt = NanoAdam([{"params": [p], "masked": True, "density": 0.5}], lr=0.1)
        p.grad = grad
        opt.step()
        picks.append(opt.state[p]["index"].tolist())
    assert picks[0] == picks[1] == [1, 3, 5]


def test_density_one_is_adamw_across_mask_recomputations():
    # mask_interval 3 over 9 steps: the mask is recomputed at steps 1, 4 and 7 and selects the
    # whole tensor each time, which must change nothing (the old reset drifted 0.030 by step 6)
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(6, 5, generator=g)
    p, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt = NanoAdam([{"params": [p], "masked": True, "density": 1.0, "mask_interval": 3}],
                   lr=0.01, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.1)
    for _ in range(9):
        grad = torch.randn(6, 5, generator=g)
        p.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(p.detach(), ref.detach(), atol=1e-6, rtol=1e-6)
    assert opt.state[p]["entry_step"].tolist() == [9] * 30


def test_a_recomputed_mask_keeps_the_moments_of_entries_that_stay():
    # entries 0, 1 are the smallest and stay selected; entry 3 leaves, entry 2 enters
    p = torch.nn.Parameter(torch.tensor([0.01, -0.02, 0.9, 0.5]))
    opt = NanoAdam([{"params": [p], "masked": True, "density": 0.75, "mask_interval": 2}], lr=1e-3)
    p.grad = torch.tensor([1.0, 2.0, 3.0, 4.0])
    opt.step()                                                          # mask {0, 1, 3}
    st = opt.state[p]
    assert st["index"].tolist() == [0, 1, 3]
    with torch.no_grad():
        p[3] = 5.0                                                      # 3 is now the largest
    opt.step()                                                          # step 2: same mask
    opt.step()                                                          # step 3: recomputed
    st = opt.state[p]
    assert st["index"].tolist() == [0, 1, 2]
    assert st["entry_step"].tolist() == [3, 3, 1]
    # kept entries: three moment updates with the same g, m = (1 - 0.9^3) g (a reset: 0.1 g)
    torch.testing.assert_close(st["exp_avg"][:2], (1 - 0.9 ** 3) * torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(st["exp_avg_sq"][:2], (1 - 0.999 ** 3) * torch.tensor([1.0, 4.0]))
    # the entering entry starts afresh: one update from zero
    torch.testing.assert_close(st["exp_avg"][2], torch.tensor(0.1 * 3.0))
    torch.testing.assert_close(st["exp_avg_sq"][2], torch.tensor(0.001 * 9.0))
    # and its first step is Adam's first step: lr * g / (|g| + eps), i.e. 1e-3
    torch.testing.assert_close(p.detach()[2], torch.tensor(0.9 - 1e-3))


def test_state_is_four_words_per_selected_entry():
    model = tiny_llama_lm()
    cfg = NanoAdamConfig(density=0.1)
    opt = build_nanoadam(model, cfg)
    _train(model, opt, 1)
    per_tensor = [(st["index"].numel(), st["index"].dtype) for st in opt.state.values() if "index" in st]
    assert all(dtype == torch.int32 for _, dtype in per_tensor)
    adamw = 2 * sum(p.numel() for p in model.parameters())
    # 4 words per selected entry (index, two moments, step count); head (64 x 16) and norms dense
    assert state_bytes(opt) == 4 * nanoadam_state_floats(model, cfg) == 4 * 4464
    assert 4464 < 0.35 * adamw
    again = build_nanoadam(model, cfg)
    again.load_state_dict(opt.state_dict())              # torch would cast them to float32
    assert {st["index"].dtype for st in again.state.values() if "index" in st} == {torch.int32}
    assert {st["entry_step"].dtype for st in again.state.values() if "index" in st} == {torch.int32}


def test_density_schedule():
    assert scheduled_density(0.2, None, 500, 1000, 100) == 0.2
    assert scheduled_density(0.2, 0.05, 1, 1000, 100) == pytest.approx(0.2)
    assert scheduled_density(0.2, 0.05, 550, 1000, 100) == pytest.approx(0.125)   # read at step 501
    assert scheduled_density(0.2, 0.05, 1001, 1000, 100) == pytest.approx(0.05)


@pytest.mark.parametrize("over,message", [({"density": 0.0}, "density: got 0.0"),
                                          ({"density": 1.5}, "density: got 1.5"),
                                          ({"final_density": -1.0}, "final_density: got -1.0"),
                                          ({"mask_interval": 0}, "mask_interval: got 0")])
def test_bad_settings(over, message):
    with pytest.raises(RankwiseError, match=message):
        from_dict(NanoAdamConfig, {"name": "nanoadam", **over}, "optim")
    assert math.isfinite(registry.get("optimizer", "nanoadam").lr_grid[0])
