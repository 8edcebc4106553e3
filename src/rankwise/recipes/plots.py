"""Plots a person would rather look at than read (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_loss(events: list[dict], path: Path, title: str = "training loss") -> Path:
    """Draw train loss (and eval loss points) against step into ``path`` (PNG)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    train = [e for e in events if "loss" in e]
    evals = [e for e in events if "eval_loss" in e]
    ax.plot([e["step"] for e in train], [e["loss"] for e in train], label="train loss", lw=1.2)
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_curves(curves: dict[str, list[tuple[float, float]]], path: Path, xlabel: str, ylabel: str,
                title: str) -> Path:
    """Draw several named ``[(x, y)]`` curves on one axis into ``path`` (PNG)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    for name, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, lw=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
