"""Write the adapters' router statistics (expert load per layer) into the run folder.

Method-agnostic: it reads the protocol's ``statistics`` capability
(:func:`rankwise.core.protocol.statistics`), so any routed adapter (``moe-lora``, ``smore``,
``lope``, ``pt-moe``, FedLEASE's mixture) reports without code in the recipes. A run with no
routed adapter writes nothing.

``router_stats.json``::

    {"step": 120, "train_steps": 120,
     "layers": {"<layer path>": {"<router>": {"experts": E,
                                              "train": {"decisions", "selected", "top1", "weight", "load"},
                                              "eval":  {...}}}}}

``train`` counts every training forward of this session (since step 0, or since the resume),
``eval`` the final evaluation only; ``load`` is each expert's share of the routing decisions
(of the gate weight for dense routers) and sums to 1. ``router_load.png`` draws ``train.load``
as a heat map, one row per router, one column per expert.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rankwise.core import atomic
from rankwise.core.protocol import reset_statistics, statistics


class AdapterStatistics:
    """Callback: reset the counters when a fit starts, write JSON + plot when it ends.

    Put it after the final :class:`~rankwise.engine.callbacks.Evaluate` (and after early
    stopping): on the last step it clears the evaluation counters, so ``eval`` describes the
    final evaluation.

    Args:
        out_dir: The run folder.
        json_name: File name of the statistics.
        plot_name: File name of the heat map (``None``: no plot).
    """

    def __init__(self, out_dir: Path, json_name: str = "router_stats.json",
                 plot_name: str | None = "router_load.png") -> None:
        self.out_dir, self.json_name, self.plot_name = Path(out_dir), json_name, plot_name
        self._start = 0

    def on_fit_start(self, engine, state) -> None:
        self._start = state.start_step
        reset_statistics(engine.model)

    def on_step_end(self, engine, state, result) -> None:
        if state.step >= state.total_steps or state.should_stop:
            reset_statistics(engine.model, ("eval",))   # keep only the final evaluation's load

    def on_fit_end(self, engine, state) -> None:
        layers = statistics(engine.model)
        if not layers:
            return
        data = {"step": state.step, "train_steps": state.step - self._start, "layers": layers}
        atomic.write_json(self.out_dir / self.json_name, data)
        if self.plot_name:
            plot_load(layers, self.out_dir / self.plot_name, f"expert load, steps {self._start}-{state.step}")


def load_rows(layers: dict[str, Any], mode: str = "train") -> list[tuple[str, list[float]]]:
    """``[(row label, load per expert)]`` of every router that saw ``mode`` forwards."""
    rows = []
    for path, routers in layers.items():
        for router, stats in routers.items():
            if mode in stats:
                label = path if router == "default" else f"{path} [{router}]"
                rows.append((label, list(stats[mode]["load"])))
    return rows


def plot_load(layers: dict[str, Any], path: Path, title: str, mode: str = "train") -> Path | None:
    """Heat map of each router's expert load (rows: routers, columns: experts).

    Args:
        layers: The ``layers`` part of ``router_stats.json``.
        path: The PNG to write.
        title: Figure title.
        mode: ``train`` or ``eval``.

    Returns:
        The file written, or None when no router saw ``mode`` forwards.
    """
    rows = load_rows(layers, mode)
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    width = max(len(r) for _, r in rows)
    grid = np.full((len(rows), width), np.nan)
    for i, (_, load) in enumerate(rows):
        grid[i, : len(load)] = load
    labels = [label for label, _ in rows]
    prefix = _common_prefix(labels)
    fig, ax = plt.subplots(figsize=(2.5 + 0.5 * width, 1.2 + 0.2 * len(rows)), dpi=110)
    image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=max(1.0 / width * 2, np.nanmax(grid)))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label[len(prefix):] or label for label in labels], fontsize=6)
    ax.set_xticks(range(width))
    ax.set_xlabel("expert")
    ax.set_title(f"{title} ({mode}; uniform = {1.0 / width:.2f})", fontsize=8)
    fig.colorbar(image, ax=ax, label="share of routing decisions")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _common_prefix(labels: list[str]) -> str:
    """The longest shared prefix of ``labels`` ending at a dot."""
    if len(labels) < 2:
        return ""
    first, last = min(labels), max(labels)
    n = next((i for i, (a, b) in enumerate(zip(first, last)) if a != b), len(first))
    return first[: first.rfind(".", 0, n) + 1]


__all__ = ["AdapterStatistics", "plot_load", "load_rows"]
