"""NGN-M: the step against Algorithm 1; the loss hook of the registry builder."""
import pytest
import torch

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.errors import RankwiseError
from rankwise.optim.ngn import NGNM, ngn_step_size
from rankwise.testing import tiny_batch, tiny_llama_lm


def test_two_steps_match_algorithm_1():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(5, 3, generator=gen)
    b = torch.randn(5, generator=gen)
    x = torch.nn.Parameter(torch.randn(3, generator=gen))
    c, beta = 0.5, 0.8
    opt = NGNM([x], lr=c, momentum=beta)

    def f_and_g(xv):
        xv = xv.detach().clone().requires_grad_(True)
        loss = ((a @ xv - b) ** 2).mean()
        loss.backward()
        return float(loss.detach()), xv.grad

    xs = [x.detach().clone()]
    for _ in range(2):
        f, g = f_and_g(x)
        gamma = c / (1 + c / (2 * f) * float(g @ g))
        prev = xs[-2] if len(xs) > 1 else xs[-1]          # x_1 = x_0
        xs.append(xs[-1] - (1 - beta) * gamma * g + beta * (xs[-1] - prev))

        def closure():
            opt.zero_grad()
            loss = ((a @ x - b) ** 2).mean()
            loss.backward()
            return loss
        opt.step(closure)
        assert opt.last_step_size == pytest.approx(gamma, rel=1e-6)
        assert torch.allclose(x.detach(), xs[-1], atol=1e-6)


def test_step_size_limits():
    assert ngn_step_size(1.0, 1.0, 0.0) == 1.0              # flat: the full step c
    assert ngn_step_size(1.0, 0.0, 3.0) == 0.0              # zero loss: no step
    assert ngn_step_size(2.0, 1.0, 1e6) == pytest.approx(2 / 1e6, rel=1e-5)  # ~ 2f/||g||^2 (Polyak)


def test_builder_observes_loss_through_forward_hook():
    model = tiny_llama_lm().train()
    entry = registry.get("optimizer", "ngn-m")
    opt = entry.builder(model, from_dict(entry.config_cls, {"name": "ngn-m"}, "optim"))
    out = model(**tiny_batch("llama"))
    out.loss.backward()
    assert opt.step() == pytest.approx(float(out.loss.detach()))
    with pytest.raises(RankwiseError, match="no loss value"):
        opt.step()
    model(**tiny_batch("llama"))                       # observed, but an explicit loss wins
    assert opt.step(loss=torch.tensor(2.5)) == 2.5
    opt.loss_hook.remove()
