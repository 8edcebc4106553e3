"""Adam's arithmetic, shared by every optimizer that keeps Adam moments: the moment update and
bias-corrected direction (for projected gradients), AdamW steps one parameter at a time or for a
whole list with torch's multi-tensor kernels, decoupled decay, and the step counter."""
from __future__ import annotations

import math

import torch


def adam_direction(state: dict, grad: torch.Tensor, beta1: float, beta2: float, eps: float,
                   step: int) -> torch.Tensor:
    """Update Adam's moments in ``state`` with ``grad`` and return the bias-corrected direction.

    Follows ``torch.optim.AdamW`` (Loshchilov & Hutter 2019, Alg. 2 lines 6-12):
    ``m <- b1 m + (1-b1) g``, ``v <- b2 v + (1-b2) g^2``,
    direction ``= (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``.

    Args:
        state: Holds (or receives, zero-initialised) ``exp_avg`` and ``exp_avg_sq`` shaped
            like ``grad``.
        grad: The (possibly projected) gradient.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the denominator.
        step: 1-based step count for bias correction.

    Returns:
        The direction (same shape as ``grad``); the caller multiplies by ``-lr``.
    """
    if "exp_avg" not in state:
        state["exp_avg"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bc1 = 1 - beta1 ** step
    bc2_sqrt = math.sqrt(1 - beta2 ** step)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    return (m / bc1).div_(denom)


def adamw_update(param: torch.Tensor, state: dict, group: dict, step: int) -> None:
    """One AdamW step on ``param`` from ``param.grad`` (``torch.optim.AdamW``'s arithmetic).

    Args:
        param: The parameter (changed in place).
        state: Its optimizer state (Adam's moments are created on first use).
        group: Its param group (``lr``, ``betas``, ``eps``, ``weight_decay``).
        step: 1-based step count (see :func:`next_step`).
    """
    adamw_updates([param], [state], group, [step])


def adamw_updates(params: list[torch.Tensor], states: list[dict], group: dict, steps: list[int]) -> None:
    """AdamW steps on several parameters of one group at once, with torch's multi-tensor
    (``_foreach``) kernels: ``torch.optim.AdamW``'s arithmetic (its ``foreach`` path), a few
    kernel launches for the whole list instead of a few per parameter.

    Args:
        params: Parameters (changed in place), each with a ``grad``.
        states: Their optimizer states (moments created on first use).
        group: Their param group (``lr``, ``betas``, ``eps``, ``weight_decay``).
        steps: Their 1-based step counts.
    """
    if not params:
        return
    lr, (beta1, beta2) = group["lr"], group["betas"]
    for p, st in zip(params, states):
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    grads = [p.grad for p in params]
    exp_avg = [st["exp_avg"] for st in states]
    exp_avg_sq = [st["exp_avg_sq"] for st in states]
    if group["weight_decay"]:
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
    torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_div_(denom, [math.sqrt(1 - beta2 ** t) for t in steps])
    torch._foreach_add_(denom, group["eps"])
    torch._foreach_addcdiv_(params, exp_avg, denom, [-lr / (1 - beta1 ** t) for t in steps])


def decay_(param: torch.Tensor, lr: float, weight_decay: float) -> None:
    """Decoupled weight decay, ``p <- p (1 - lr wd)``, applied before the update as in AdamW."""
    if weight_decay:
        param.mul_(1 - lr * weight_decay)


def next_step(state: dict) -> int:
    """Increment ``state["step"]`` (a 0-dim float tensor, as torch's optimizers keep it; a plain
    int from an older checkpoint is converted).

    Returns:
        The new 1-based step count as an int.
    """
    if not torch.is_tensor(state.get("step")):
        state["step"] = torch.tensor(float(state.get("step", 0)))
    state["step"] += 1
    return int(state["step"].item())
