"""Write and draw GoRA's allocation: ``ranks.json`` and a bar chart of rank per layer."""
from __future__ import annotations

from pathlib import Path

from rankwise.core import atomic


def _short(path: str) -> str:
    """``encoder.layer.3.attention.self.query`` -> ``3.attention.self.query``."""
    parts = path.split(".")
    digits = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[digits[0]:]) if digits else path


def write_ranks(report: dict, path: str | Path) -> Path:
    """Write the report (ranks, importances, budget, memory) as JSON, atomically.

    Args:
        report: From :func:`rankwise.adapters.gora.gora_report`.
        path: Target file, usually ``<run>/ranks.json``.

    Returns:
        The path written.
    """
    path = Path(path)
    atomic.write_json(path, report)
    return path


def plot_ranks(report: dict, path: str | Path) -> Path:
    """Draw rank per layer (bars, with r0 as a line) above importance per layer.

    Args:
        report: From :func:`rankwise.adapters.gora.gora_report`.
        path: Target image (``.png``/``.svg``); its folder is created.

    Returns:
        The path written.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["ranks"])
    ranks = [report["ranks"][n] for n in names]
    imps = [report["importances"][n] for n in names]
    x = range(len(names))
    width = max(6.0, 0.28 * len(names))
    fig, (ax_r, ax_i) = plt.subplots(2, 1, figsize=(width, 6.5), sharex=True)
    ax_r.bar(x, ranks, color=["#c44" if r == 0 else "#3a6ea5" for r in ranks])
    ax_r.axhline(report["r0"], color="k", lw=1, ls="--", label=f"uniform LoRA r0={report['r0']}")
    ax_r.set_ylabel("allocated rank")
    ax_r.set_title(f"GoRA rank allocation ({report['allocated_params']:,} / "
                   f"{report['budget_params']:,} budget params, importance={report['importance']})")
    ax_r.legend(loc="upper left")
    ax_i.bar(x, imps, color="#888")
    ax_i.set_ylabel("importance")
    ax_i.set_xticks(list(x))
    ax_i.set_xticklabels([_short(n) for n in names], rotation=90, fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
