"""What ``rankwise train --resume`` may change, and how the learning rate continues.

A resumed run must be the run it continues: every setting is compared with the run folder's
``config.yaml`` and a difference is named by its dotted key (``optim.lr``). One setting may
change: ``train.steps``, to extend a finished or interrupted run (``--resume --set
train.steps=N``) or shorten an interrupted one, never below the steps already done.

The schedule when ``train.steps`` changes from ``S0`` to ``S`` at step ``k`` (the newest
checkpoint): the run's own schedule (:func:`rankwise.engine.linear_schedule`, warm-up then
linear decay to zero at ``S0``) stands at factor ``f0 = f(k; S0)``; a finished run stands at
``0``. Restarting the schedule for ``S`` would jump to ``f(k; S)`` (issue 18: lr 0.0 at step 4,
0.00214 at step 5); instead the factor moves linearly from ``f0`` to the new schedule's value at ``t = k + w``
over the new run's warm-up length ``w = max(1, int(S * warmup_fraction))`` steps (a re-warm-up
for a finished run), then follows ``f(i; S)`` to zero at ``S``. Inside the ramp each step
changes the factor by at most ``1 / w``, the step of a fresh warm-up: no jump. The checkpoint's
``meta.json`` records each change (``schedule_extensions``), so a resume inside the ramp stays
exact; with ``S = S0`` nothing changes.
"""
from __future__ import annotations

from typing import Any, Callable


def dotted_diff(saved: Any, now: Any, prefix: str = "") -> list[str]:
    """The dotted keys where two nested mappings differ (``["optim.lr", "train.seed"]``).

    Args:
        saved: The run's config (plain data).
        now: The config given now.
        prefix: Key path of ``saved``/``now`` (recursion).

    Returns:
        Sorted dotted keys; a key present on one side only counts as different.
    """
    if isinstance(saved, dict) and isinstance(now, dict):
        out: list[str] = []
        for key in sorted(set(saved) | set(now), key=str):
            out += dotted_diff(saved.get(key), now.get(key), f"{prefix}{key}.")
        return out
    return [] if saved == now else [prefix.rstrip(".")]


def linear_factor(steps: int, warmup_fraction: float) -> Callable[[int], float]:
    """The factor of :func:`rankwise.engine.linear_schedule` after ``step`` scheduler steps
    (the same formula; ``tests/recipes/test_resume.py`` holds them equal)."""
    warm = max(1, int(steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return max(0.0, (steps - step) / max(1, steps - warm))

    return factor


def _bridge(old: Callable[[int], float], steps: int, warmup_fraction: float,
            at: int) -> Callable[[int], float]:
    """``old`` before step ``at``; then linear to the ``steps`` schedule in its warm-up length."""
    new = linear_factor(steps, warmup_fraction)
    f0 = old(at)
    end = min(at + max(1, int(steps * warmup_fraction)), steps)

    def factor(i: int) -> float:
        if i < at:
            return old(i)
        if i < end:  # linear from f0 (where the run stood) to the new schedule's value at `end`
            return f0 + (new(end) - f0) * (i + 1 - at) / (end - at)
        return new(i)

    return factor


def schedule_factor(steps: int, warmup_fraction: float,
                    extensions: list[tuple[int, int]] = ()) -> Callable[[int], float]:
    """The learning-rate factor of a run now scheduled for ``steps`` whose ``train.steps`` was
    changed by ``extensions`` (see the module docstring).

    Args:
        steps: ``train.steps`` now.
        warmup_fraction: ``train.warmup_fraction``.
        extensions: ``(train.steps before, steps done)`` of each change, oldest first (the
            checkpoint's ``meta.json`` keeps them, so a second resume continues exactly).

    Returns:
        ``factor(i)``: the learning rate is ``lr * factor(i)`` after ``i`` scheduler steps.
    """
    extensions = [tuple(e) for e in extensions]
    factor = linear_factor(extensions[0][0] if extensions else steps, warmup_fraction)
    for j, (_, at) in enumerate(extensions):
        to = extensions[j + 1][0] if j + 1 < len(extensions) else steps
        factor = _bridge(factor, to, warmup_fraction, at)
    return factor


def set_schedule(scheduler, factor: Callable[[int], float]) -> None:
    """Make a loaded ``LambdaLR`` follow ``factor`` from its current step on (the optimizer's
    learning rates, restored from the checkpoint, are set to the factor's value there)."""
    scheduler.lr_lambdas = [factor] * len(scheduler.lr_lambdas)
    lrs = [base * factor(scheduler.last_epoch) for base in scheduler.base_lrs]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
