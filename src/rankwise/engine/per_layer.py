"""Per-layer updates: each parameter steps as soon as its gradient is complete, and the gradient
is freed, so a step never holds every gradient at once (the per-layer weight updates of GaLore,
Zhao et al. 2024, after LOMO, Lv et al. 2023).

Mechanism: a ``register_post_accumulate_grad_hook`` on every trainable parameter. When autograd
has accumulated a parameter's gradient, the hook calls ``optimizer.step()`` and sets the
gradient to ``None``. At that moment no other parameter holds a gradient (those stepped before
were freed, the rest are not computed yet), and torch optimizers (and rankwise's
``MatrixAdamW`` family) skip parameters without one, so the call updates exactly this
parameter, with its own state, its param group's learning rate and weight decay. That is one
optimizer acting as one optimizer per parameter: the update equals the ordinary step's whenever
the rule is per-parameter (AdamW, GaLore), and the state dict is the ordinary optimizer's, so
checkpoints are the same files and resume exactly.

Not exact, hence refused by :func:`problems`: gradient accumulation (a parameter would step on
each micro-batch), global-norm clipping and the fp16 gradient scaler (both need every gradient
before any step), several processes (gradients are summed across processes after the
backward). The learning-rate schedule is stepped after the backward, as in the ordinary step.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from rankwise.errors import RankwiseError


def problems(grad_accum: int, grad_clip: float | None, precision: str, processes: int) -> list[str]:
    """Why per-layer updates cannot equal the ordinary step with these settings (one line each).

    Args:
        grad_accum: Micro-batches per step.
        grad_clip: Global gradient-norm clip (``None``/0 = off).
        precision: ``fp32``, ``bf16`` or ``fp16``.
        processes: Processes of the run.

    Returns:
        The problems (empty when per-layer updates are exact).
    """
    out = []
    if grad_accum > 1:
        out.append(f"optim.per_layer steps each parameter during the backward, so it cannot "
                   f"accumulate gradients (train.grad_accum: {grad_accum}); set train.grad_accum: 1")
    if grad_clip:
        out.append(f"optim.per_layer steps each parameter before the other gradients exist, so it "
                   f"cannot clip by their global norm (train.grad_clip: {grad_clip}); set "
                   "train.grad_clip: null")
    if precision == "fp16":
        out.append("optim.per_layer cannot wait for fp16's gradient scaler to check every gradient; "
                   "set train.precision: bf16 or fp32")
    if processes > 1:
        out.append("optim.per_layer would step before the gradients are summed across processes; "
                   "run it in one process")
    return out


class PerLayerUpdates:
    """Steps ``optimizer`` once per parameter in the parameter's post-accumulate-grad hook.

    The hooks are registered at the first :meth:`arm` (an engine built only to evaluate adds
    none) and act only between :meth:`arm` and :meth:`disarm` (the engine arms them around a
    training step's backward), so other backward passes (a data-driven initialisation) leave
    the gradients alone.

    Args:
        params: The trainable parameters (each once).
        optimizer: The optimizer over them.
    """

    def __init__(self, params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self.armed = False
        self._stepped: set[int] = set()
        self._handles: list = []

    def arm(self) -> None:
        """Start a step: the next backward updates every parameter it reaches."""
        if not self._handles:
            self._handles = [p.register_post_accumulate_grad_hook(self._step) for p in self.params]
        self.armed, self._stepped = True, set()

    def disarm(self) -> None:
        """End the step."""
        self.armed = False

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _step(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        if id(p) in self._stepped:  # reentrant checkpointing runs nested backwards
            raise RankwiseError("optim.per_layer: a parameter received its gradient twice in one "
                                "backward (reentrant activation checkpointing?); use the "
                                "non-reentrant checkpointing of train.gradient_checkpointing or "
                                "optim.per_layer: false")
        self._stepped.add(id(p))
        self.optimizer.step()       # only p holds a gradient now: only p moves
        p.grad = None


__all__ = ["PerLayerUpdates", "problems"]
