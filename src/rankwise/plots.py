"""Plots a person would rather look at than read (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path


def plot_curves(curves: dict[str, list[tuple[float, float]]], path: Path, xlabel: str, ylabel: str,
                title: str, styles: dict[str, str] | None = None) -> Path:
    """Draw several named ``[(x, y)]`` curves on one axis into ``path`` (PNG).

    Args:
        curves: Curve name -> points.
        path: The PNG to write.
        xlabel: X axis label.
        ylabel: Y axis label.
        title: Figure title.
        styles: Optional matplotlib format string per curve name (``"o-"``).

    Returns:
        ``path``.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    for name, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], (styles or {}).get(name, "-"), label=name, lw=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_loss(events: list[dict], path: Path, title: str = "training loss") -> Path:
    """Draw train loss (and eval loss points) against step from ``events.jsonl`` lines."""
    curves = {"train loss": [(e["step"], e["loss"]) for e in events if "loss" in e]}
    evals = [(e["step"], e["eval_loss"]) for e in events if "eval_loss" in e]
    if evals:
        curves["eval loss"] = evals
    return plot_curves(curves, path, "step", "loss", title, styles={"eval loss": "o-"})
