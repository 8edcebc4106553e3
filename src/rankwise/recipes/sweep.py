"""Equal tuning for ``rankwise compare``: a learning-rate sweep per row on a validation split.

Every row gets the same number of grid points. A row's grid comes from the comparison's YAML
(``compare: {row: {lr_grid: [...]}}``) or else from its optimizer's registry entry (``lr_grid``,
resampled geometrically between its ends when another number of points is asked for). Each
point trains seed 0 with ``data.holdout: validation`` - a deterministic slice carved from the
*training* data is held out and evaluated - so the evaluation split never influences the
choice. The best point (highest validation accuracy, else lowest validation loss; ties go to
the lower loss) is then trained with every seed and reported on the evaluation split.
"""
from __future__ import annotations

import copy
import math

from rankwise import registry
from rankwise.errors import RankwiseError

GRID_KEY = "lr_grid"


def resample(grid: list[float], points: int) -> list[float]:
    """``points`` learning rates spaced geometrically from ``min(grid)`` to ``max(grid)``."""
    lo, hi = min(grid), max(grid)
    if points == 1:
        return [math.sqrt(lo * hi)]
    return [lo * (hi / lo) ** (i / (points - 1)) for i in range(points)]


def row_grid(row: str, plan: dict, given: list | None, points: int) -> list[float]:
    """The learning rates row ``row`` is swept over.

    Args:
        row: The row name (for messages).
        plan: The row's raw run config (its ``optim.name`` picks the registry grid).
        given: The row's ``lr_grid`` from the comparison's YAML, if any.
        points: Grid points every row must have.

    Returns:
        ``points`` positive learning rates, ascending.

    Raises:
        RankwiseError: If a given grid has another number of points or non-positive values,
            or the optimizer registers no grid and none is given.
    """
    if given is not None:
        if (not isinstance(given, list) or len(given) != points
                or not all(isinstance(v, (int, float)) and v > 0 for v in given)):
            raise RankwiseError(f"compare.{row}.{GRID_KEY}: got {given!r}; expected {points} positive "
                                f"learning rates (every row gets the same number of points: --lr-grid {points})")
        return sorted(float(v) for v in given)
    name = (plan.get("optim") or {}).get("name", "adamw")
    grid = list(registry.get("optimizer", name).lr_grid)
    if not grid:
        raise RankwiseError(f"row {row!r}: optimizer {name!r} registers no lr_grid; give one with "
                            f"compare: {{{row}: {{{GRID_KEY}: [...]}}}}")
    return sorted(grid) if len(grid) == points else resample(grid, points)


def sweep_plan(plan: dict, lr: float) -> dict:
    """The raw config of one sweep point: ``plan`` at ``lr``, seed 0, validation holdout."""
    out = copy.deepcopy(plan)
    out.setdefault("optim", {})["lr"] = float(lr)
    out.setdefault("train", {})["seed"] = 0
    out.setdefault("data", {})["holdout"] = "validation"
    return out


def best_point(results: dict[float, dict]) -> float:
    """The learning rate whose validation metrics are best.

    Args:
        results: ``{lr: metrics.json of its sweep run}``.

    Returns:
        The chosen learning rate.
    """
    def key(lr: float) -> tuple:
        m = results[lr]
        acc = m.get("eval_accuracy")
        return (-(acc if acc is not None else 0.0), m.get("eval_loss", math.inf), lr)
    return min(results, key=key)
