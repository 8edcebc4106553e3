"""t-SignSGD: the quantile schedule, one +-1 grid step for the entries above it (hand-checked),
the second-phase spike filter, and the pairing with LoTA-QAF's ternary adapters."""
import pytest
import torch

import rankwise
from rankwise.core.ops import adapter_parameters
from rankwise.optim.tsignsgd import TSignSGD, TSignSGDConfig, build_tsignsgd, quantile_at, ternary_parameters
from rankwise.testing import tiny_batch, tiny_bert_cls


def test_quantile_schedule():
    args = dict(total=100, start=0.95, mid=0.999, end=0.9999, split=0.8)
    assert quantile_at(1, **args) == pytest.approx(0.95)
    assert quantile_at(41, **args) == pytest.approx(0.95 + 0.049 * 0.5)
    assert quantile_at(81, **args) == pytest.approx(0.999)
    assert quantile_at(91, **args) == pytest.approx(0.999 + 0.0009 * 0.5)
    assert quantile_at(500, **args) == pytest.approx(0.9999)


def test_one_step_moves_the_top_entries_by_one_and_stays_ternary():
    p = torch.nn.Parameter(torch.tensor([[1.0, 0.0, -1.0, 0.0], [1.0, -1.0, 0.0, 0.0]]))
    grad = torch.tensor([[-3.0, 0.1, 2.5, -0.2], [0.05, 4.0, 0.0, -2.0]])
    opt = TSignSGD([{"params": [p], "ternary": True}], total_steps=10, start_quantile=0.5)
    p.grad = grad
    opt.step()
    # q = 0.5 of 8 entries: the 4th smallest |g| (0.2) is the threshold; 4 entries are above it.
    # +1 - sign(-3) = 2 -> clipped 1; -1 - sign(2.5) = -2 -> -1; -1 - sign(4) -> -1; 0 - sign(-2) -> 1
    assert p.detach().tolist() == [[1.0, 0.0, -1.0, 0.0], [1.0, -1.0, 0.0, 1.0]]
    q = torch.nn.Parameter(torch.zeros(2, 4))
    opt = TSignSGD([{"params": [q], "ternary": True}], total_steps=10, start_quantile=0.5)
    q.grad = grad
    opt.step()
    assert q.detach().tolist() == [[1.0, 0.0, -1.0, 0.0], [0.0, -1.0, 0.0, 1.0]]


def test_second_phase_skips_spikes_when_the_norm_is_large():
    grad = torch.arange(1.0, 101.0).reshape(10, 10)          # global norm 581 > spike_norm
    p = torch.nn.Parameter(torch.zeros(10, 10))
    opt = TSignSGD([{"params": [p], "ternary": True}], total_steps=10, start_quantile=0.5,
                   mid_quantile=0.9, end_quantile=0.9, phase_split=0.5, spike_quantile=0.98)
    opt.state[p]["step"] = torch.tensor(5.0)                   # the next step is step 6 of 10:
    p.grad = grad                                             # the second phase, q = 0.9
    opt.step()
    moved = (p.detach() != 0).flatten().nonzero().flatten().tolist()
    assert moved == [90, 91, 92, 93, 94, 95, 96, 97]          # above q(0.9) = 90, at most q(0.98) = 98


def test_lota_adapters_are_ternary_and_the_head_is_adamw():
    model = tiny_bert_cls()
    rankwise.apply(model, "lota-qaf", r=4)
    ternary = ternary_parameters(model)
    adapter = adapter_parameters(model)
    assert {id(p) for p in ternary} == {id(p) for k, p in adapter.items() if ".lota_" in k}
    opt = build_tsignsgd(model, TSignSGDConfig(total_steps=5, lr=1e-2))
    head = model.classifier.weight.detach().clone()
    model.train()
    for s in range(5):
        opt.zero_grad()
        model(**tiny_batch("bert", seed=s)).loss.backward()
        opt.step()
    values = torch.cat([p.detach().flatten() for p in ternary]).unique().tolist()
    assert set(values) <= {-1.0, 0.0, 1.0} and len(values) == 3
    assert any(bool((p.detach() != 0).any()) for k, p in adapter.items() if k.endswith("lota_B"))
    assert not torch.equal(head, model.classifier.weight.detach())
