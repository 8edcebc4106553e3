"""One engine step against a hand-written one: token-normalised gradient accumulation, loss
hooks weighted by their micro-batch's share, autocast in bf16 / fp16 (with the gradient
scaler), the non-finite and overflow stops, the batch order and the learning-rate schedule."""
from __future__ import annotations

import copy

import pytest
import torch

from engine_helpers import ToyLM, engine, examples, token_mean_loss
from rankwise.engine import NonFiniteLoss, batch_indices, linear_schedule
from rankwise.engine.loop import split
from rankwise.engine.precision import precision_problem
from rankwise.errors import RankwiseError

LR = 0.5


def hand_step(model, seqs, extra=None):
    """``(loss, {name: parameter after one SGD step})`` of the token-mean loss (+ ``extra``)."""
    ref = copy.deepcopy(model)
    loss = token_mean_loss(ref, seqs)
    objective = loss + (extra(ref) if extra else 0)
    objective.backward()
    return float(loss.detach()), {n: (p - LR * p.grad).detach() for n, p in ref.named_parameters()}


def step_seqs(data, step=0, batch_size=6, seed=0):
    return [data[i]["input_ids"] for i in batch_indices(step, len(data), batch_size, seed)]


@pytest.mark.parametrize("grad_accum", [1, 2, 3, 4])
def test_a_step_is_sgd_on_the_token_mean_loss_whatever_the_accumulation(grad_accum):
    data, model = examples(), ToyLM()
    seqs = step_seqs(data)
    want_loss, want = hand_step(model, seqs)
    eng = engine(model, data, LR, grad_accum=grad_accum)
    result = eng.train_step(0)
    assert len(eng.step_batches(0)) == grad_accum
    assert result.loss == pytest.approx(want_loss, abs=1e-6)
    assert result.examples == 6
    assert result.targets == sum(len(s) - 1 for s in seqs) and result.tokens == sum(map(len, seqs))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name], atol=1e-6, rtol=0)


def test_the_data_are_uneven_enough_that_a_mean_of_micro_batch_means_differs():
    """What accumulation equality guards against (transformers PR#34191)."""
    data, model = examples(), ToyLM()
    micro = split(step_seqs(data), 3)
    assert len({sum(len(s) - 1 for s in m) for m in micro}) == 3   # different target counts
    with torch.no_grad():
        mean_of_means = sum(float(token_mean_loss(model, m)) for m in micro) / 3
        token_mean = float(token_mean_loss(model, [s for m in micro for s in m]))
    assert abs(mean_of_means - token_mean) > 1e-3


def test_loss_hooks_add_once_per_step_and_are_logged_by_name():
    data, model = examples(), ToyLM()
    hook = lambda m, step: 0.1 * (m.head.weight ** 2).sum()                     # noqa: E731
    before = float(hook(model, 0).detach())
    _, want = hand_step(model, step_seqs(data), extra=lambda m: hook(m, 0))
    result = engine(model, data, LR, grad_accum=3, loss_hooks={"l2": hook}).train_step(0)
    assert result.aux == {"l2": pytest.approx(before, rel=1e-6)}
    torch.testing.assert_close(model.head.weight.detach(), want["head.weight"], atol=1e-6, rtol=0)


def _dtypes_seen(eng):
    seen = []
    handle = eng.model.proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    result = eng.train_step(0)
    handle.remove()
    return seen, result


@pytest.mark.parametrize("precision, dtype, rtol", [
    ("fp32", torch.float32, 0.0),
    # four unit roundoffs of the dtype (2^-8 for bf16, 2^-11 for fp16; measured: 1.1 of them);
    # an fp16 step that skipped unscaling would be 2^16 times too large
    ("bf16", torch.bfloat16, 4 * 2.0 ** -8),
    ("fp16", torch.float16, 4 * 2.0 ** -11),
])
def test_autocast_runs_the_forward_in_the_precision_and_the_update_stays_sgd(precision, dtype, rtol):
    data, model = examples(), ToyLM()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, want = hand_step(model, step_seqs(data))
    eng = engine(model, data, LR, grad_accum=2, precision=precision)
    seen, result = _dtypes_seen(eng)
    assert seen == [dtype, dtype] and isinstance(result.loss, float)
    assert all(p.dtype == torch.float32 for p in model.parameters())        # float32 master weights
    worst = 0.0
    for name, p in model.named_parameters():
        want_update, got_update = want[name] - start[name], p.detach() - start[name]
        worst = max(worst, float((got_update - want_update).norm() / want_update.norm()))
    if precision == "fp32":
        assert worst < 1e-5
    else:
        assert 0 < worst < rtol            # low precision changes the update, but only by rounding
    assert (eng.scaler is not None) == (precision == "fp16") == ("scaler" in eng.state_dict())
    if eng.scaler is not None:
        assert eng.scaler.get_scale() == 2.0 ** 16   # a finite step keeps the initial scale


def test_precision_is_checked_by_name_and_by_device():
    with pytest.raises(RankwiseError, match=r"train.precision: got 'fp8'; expected one of \['fp32', 'bf16', 'fp16'\]"):
        engine(precision="fp8")
    assert precision_problem("fp32", "cpu") is None and precision_problem("bf16", "cpu") is None
    if not torch.cuda.is_available():
        reason = precision_problem("fp16", "cuda")
        assert reason.startswith("train.precision fp16: cuda cannot run torch.float16 autocast")
        assert reason.endswith("; set train.precision to bf16 or fp32")


def test_a_non_finite_loss_stops_before_any_update():
    model = ToyLM()
    start = copy.deepcopy(model.state_dict())
    eng = engine(model, loss_hooks={"boom": lambda m, step: torch.tensor(float("inf"))})
    with pytest.raises(NonFiniteLoss) as err:
        eng.train_step(4)
    assert (err.value.step, err.value.value) == (5, float("inf"))
    assert str(err.value) == "loss became inf at step 5; lower optim.lr or set train.grad_clip"
    assert all(torch.equal(p, start[n]) for n, p in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


class Overflowing(torch.optim.SGD):
    """SGD whose step fails like AdamW at a learning rate beyond float range."""

    message = "value cannot be converted to type float without overflow"

    def step(self, closure=None):
        raise RuntimeError(self.message)


def test_an_optimizer_overflow_is_a_non_finite_stop_and_other_errors_pass_through():
    eng = engine()
    eng.optimizer = Overflowing(eng.params, lr=0.1)
    with pytest.raises(NonFiniteLoss, match="the optimizer's update overflowed .* at step 3;") as err:
        eng.train_step(2)
    assert err.value.value is None and all(p.grad is None for p in eng.params)
    Overflowing.message = "some other failure"
    try:
        with pytest.raises(RuntimeError, match="some other failure"):
            eng.train_step(2)
    finally:
        Overflowing.message = "value cannot be converted to type float without overflow"
    eng.params[0].data[0] = float("nan")
    with pytest.raises(NonFiniteLoss, match="at step 7;"):
        eng.check_finite(7)


def test_batches_are_a_fresh_permutation_per_epoch_and_a_pure_function_of_the_step():
    n, bs = 10, 4
    drawn = [batch_indices(s, n, bs, seed=3) for s in range(5)]                 # 20 = two epochs
    flat = [i for b in drawn for i in b]
    assert sorted(flat[:10]) == sorted(flat[10:]) == list(range(10)) and flat[:10] != flat[10:]
    assert drawn == [batch_indices(s, n, bs, seed=3) for s in reversed(range(5))][::-1]
    assert batch_indices(0, n, bs, seed=4) != drawn[0]
    assert split(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split([0, 1], 4) == [[0], [1]]


def test_linear_schedule_warms_up_then_decays_to_zero():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = linear_schedule(opt, steps=10, warmup_fraction=0.2)                  # 2 warm-up steps
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8])
    assert opt.param_groups[0]["lr"] == 0.0
