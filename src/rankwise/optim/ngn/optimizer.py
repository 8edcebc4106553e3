"""NGN-M: momentum with the NGN adaptive step size (needs the loss value)."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from rankwise.errors import RankwiseError
from rankwise.optim.common import trainable_parameters
from rankwise.optim.ngn.config import NGNMConfig


def ngn_step_size(c: float, loss: float, grad_sq_norm: float) -> float:
    """NGN step ``gamma = c / (1 + c ||g||^2 / (2 f))`` (0 when ``f <= 0``: at a zero loss,
    the model is at a minimum of a non-negative loss and NGN takes no step)."""
    if loss <= 0:
        return 0.0
    return c / (1 + c * grad_sq_norm / (2 * loss))


class NGNM(torch.optim.Optimizer):
    """NGN-M (Islamov, Ajroldi, Orvieto, Lucchi; NeurIPS 2025, Algorithm 1)::

        gamma_k = c / (1 + c ||g_k||^2 / (2 f_k))
        x_{k+1} = x_k - (1 - beta) gamma_k g_k + beta (x_k - x_{k-1})

    ``f_k`` is the mini-batch loss (assumed non-negative, as a cross-entropy is) and ``||g_k||``
    the norm of the whole gradient over every parameter of the optimizer. The state keeps the
    last displacement ``x_k - x_{k-1}`` (``momentum_buffer``, one tensor per parameter); it is
    zero at the start (``x_1 = x_0``). Choices: a group's own ``lr`` is its ``c`` (the norm is
    always global); weight decay is decoupled and scaled by ``gamma``:
    ``x <- x (1 - gamma wd)`` before the step. Under ``torch.distributed`` the loss is averaged
    over processes (gradients already are), so every process takes the same step.

    The loss reaches the optimizer in one of two ways: ``step(closure)`` (the closure
    re-evaluates and returns it, torch's convention), ``step(loss=value)`` (the rankwise training
    loop does this, seeing ``needs_closure_loss``), or :meth:`observe_loss` before ``step()``;
    the registry builder installs a forward hook that observes ``output.loss`` of every
    training-mode forward, averaging them over gradient-accumulation micro-batches.

    Args:
        params: Parameters or param-group dicts.
        lr: ``c``.
        momentum: ``beta``.
        weight_decay: Decoupled weight decay.
    """

    def __init__(self, params: Iterable, lr: float = 1e-2, momentum: float = 0.9,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self._losses: list[torch.Tensor] = []
        self.last_step_size = 0.0
        self.needs_closure_loss = True  # tells rankwise.recipes.train to call step(loss=...)

    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Record a mini-batch loss for the next :meth:`step` (several are averaged)."""
        self._losses.append(torch.as_tensor(loss, dtype=torch.float64).detach().cpu())

    @torch.no_grad()
    def step(self, closure: Callable | None = None, loss: torch.Tensor | float | None = None):
        """Perform one step.

        Args:
            closure: Optional closure returning the loss (after its backward pass).
            loss: The mini-batch loss, if known (overrides losses seen by the hook).

        Returns:
            The loss used.

        Raises:
            RankwiseError: If no loss was given by a closure or :meth:`observe_loss`.
        """
        if closure is not None:
            with torch.enable_grad():
                self._losses = [torch.as_tensor(closure(), dtype=torch.float64).detach().cpu()]
        elif loss is not None:
            self._losses = [torch.as_tensor(loss, dtype=torch.float64).detach().cpu()]
        if not self._losses:
            raise RankwiseError("ngn-m: got no loss value for this step; expected "
                                "optimizer.step(closure) or optimizer.observe_loss(loss) "
                                "before step() (models whose output has .loss are observed "
                                "automatically when the optimizer is built by the registry)")
        f = torch.stack(self._losses).mean()
        self._losses = []
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(f, op=dist.ReduceOp.SUM)
            f /= dist.get_world_size()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        sq = float(sum((g.double() ** 2).sum() for g in grads)) if grads else 0.0
        for group in self.param_groups:
            gamma = ngn_step_size(group["lr"], float(f), sq)
            self.last_step_size = gamma
            beta = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                d = state["momentum_buffer"]
                if group["weight_decay"]:
                    p.mul_(1 - gamma * group["weight_decay"])
                d.mul_(beta).add_(p.grad, alpha=-(1 - beta) * gamma)  # x_{k+1} - x_k
                p.add_(d)
        return f.item()


def _loss_hook(optimizer: NGNM) -> Callable:
    def hook(module: nn.Module, args, output) -> None:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if module.training and loss is not None and torch.is_tensor(loss):
            optimizer.observe_loss(loss)
    return hook


def build_ngnm(model: nn.Module, config: NGNMConfig) -> NGNM:
    """Registry builder for ``ngn-m`` over every trainable parameter.

    Also registers a forward hook on ``model`` that feeds ``output.loss`` to the optimizer
    (the handle is ``optimizer.loss_hook``; call ``.remove()`` to detach it).

    Args:
        model: The model to train.
        config: The ``optim:`` section.

    Returns:
        The optimizer.
    """
    opt = NGNM(trainable_parameters(model), lr=config.lr, momentum=config.momentum,
               weight_decay=config.weight_decay)
    opt.loss_hook = model.register_forward_hook(_loss_hook(opt))
    return opt
