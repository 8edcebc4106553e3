"""The human side of ``rankwise inspect``: ``report.md`` and the plots, from ``inspect.json``'s dict."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rankwise.plots import plot_curves


def _safe(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", path)


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """Per-layer gradient spectra (one curve per state), effective rank through training,
    each method's layer score (GoRA's importance) vs entropy rank, the Shapley histogram and the inverse bound per matrix."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    states = report["gradients"]["states"]
    (out / "spectra").mkdir(exist_ok=True)
    layers = list(next(iter(states.values())))
    for layer in layers:
        curves = {label: [(i + 1, s / max(rows[layer]["singular_values"][0], 1e-30))
                          for i, s in enumerate(rows[layer]["singular_values"])]
                  for label, rows in states.items()}
        written.append(plot_curves(curves, out / "spectra" / f"{_safe(layer)}.png", "index",
                                   "σ_i / σ_1", f"gradient spectrum: {layer}"))
    curves = {layer: [(j, rows[layer]["entropy"]) for j, rows in enumerate(states.values())] for layer in layers}
    written.append(plot_curves(curves, out / "effective_rank.png", "state (0 = base; "
                               + ", ".join(states) + ")", "entropy rank", "gradient effective rank"))
    last = list(states.values())[-1]
    for name in report["gradients"]["layer_scores"]:  # e.g. GoRA's importance, beside the rank
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
        ax.scatter([last[l]["entropy"] for l in layers], [last[l]["layer_scores"][name] for l in layers])
        ax.set_xlabel("gradient entropy rank")
        ax.set_ylabel(f"{name} layer score")
        ax.set_title(f"{name}'s layer score vs gradient rank (last state)")
        fig.tight_layout()
        fig.savefig(out / f"{name}_score_vs_rank.png")
        plt.close(fig)
        written.append(out / f"{name}_score_vs_rank.png")
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    ax.hist(report["shapley"]["values"], bins=60)
    ax.set_xlabel("neuron Shapley value φ (loss units)")
    ax.set_ylabel("neurons")
    ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(out / "shapley_hist.png")
    plt.close(fig)
    written.append(out / "shapley_hist.png")
    for layer, m in report["inverse"]["matrices"].items():
        for which in ("raw", "half", "small"):
            rows = m[which]
            curves = {"measured": [(r["p"], r["measured"]) for r in rows],
                      "paper bound": [(r["p"], r["bound"]) for r in rows if r["bound"] is not None],
                      "naive bound": [(r["p"], r["naive"]) for r in rows if r["naive"] is not None]}
            path = out / f"inverse_{which}_{_safe(layer)}.png"
            plot_curves({k: v for k, v in curves.items() if v}, path, "p", "spectral norm",
                        f"low-rank inverse ({which} E): {layer}", styles={k: "o-" for k in curves})
            written.append(path)
    return written


def _fmt(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def write_report(report: dict[str, Any], out: Path) -> Path:
    """``report.md``: the tables, the conclusions and the plot names."""
    g = report["gradients"]
    lines = [f"# rankwise inspect: {report['target']}", "",
             f"{report['kind']}; targets `{report['targets']}`; {report['calibration_batches']} calibration "
             f"batches of {report['batch_size']}. Every number is in `inspect.json`.", "",
             "## Gradient structure", "",
             "Mean loss gradient over the calibration batches per targeted weight: entropy rank "
             "exp(H(σ/Σσ)), 90 %/99 % energy ranks, and the layer score of every method built "
             "from (W, G) (GoRA: its importance at its default settings) from the same gradient. "
             "Plots: `spectra/`, `effective_rank.png`, `<method>_score_vs_rank.png`.", "",
             "| state | layer | dim | entropy rank | energy 90 % | energy 99 % | ‖G‖_F | "
             + " | ".join(f"{n} score" for n in g["layer_scores"]) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(g["layer_scores"])]
    for label, rows in g["states"].items():
        for layer, r in rows.items():
            lines.append(f"| {label} | `{layer}` | {r['dim']} | {r['entropy']:.2f} | {r['energy90']} | "
                         f"{r['energy99']} | {r['grad_norm']:.3g} | "
                         + " | ".join(f"{r['layer_scores'][n]:.3g}" for n in g["layer_scores"]) + " |")
    s = report["shapley"]
    lines += ["", "## Model Shapley (last state)", "",
              "φ = -g⊙θ + ½ θ⊙(Fθ) per weight (F: block-diagonal empirical Fisher, one block per "
              "output neuron; EWMA over batches), summed per neuron. "
              f"Top {s['fraction']:.0%} = {s['top_k']} neurons; their overlap with the top by "
              + ", ".join(f"{k}: {v:.0%}" for k, v in s["overlap_with_shapley"].items())
              + ". Histogram: `shapley_hist.png`.", "",
              "| layer | neurons | Σφ | max φ | share in the top set |", "|---|---|---|---|---|"]
    for layer, r in s["layers"].items():
        lines.append(f"| `{layer}` | {r['neurons']} | {r['sum']:.3g} | {r['max']:.3g} | {r['top_fraction']:.0%} |")
    inv = report["inverse"]
    lines += ["", "## Low-rank inverse bound", "",
              f"A = XᵀX/N of a layer's inputs on the calibration batches + {inv['damping']}·mean(diag)·I; "
              "Ã = the same on other batches; E = Ã - A. `raw`: that E (the paper's condition "
              "4‖E‖ ≤ min(λ_n, δ_{n-p}) often fails: bound n/a); `half` / `small`: E shrunk to "
              "4‖E‖ = ½ / 1 % of min(λ_n, δ_{n-p}). "
              f"Paper bound held on every applicable case ({inv['applicable_cases']}): **{inv['bound_held_everywhere']}**.", "",
              "| layer | E | p | ‖E‖ | λ_n | δ_{n-p} | measured | paper bound | naive bound |",
              "|---|---|---|---|---|---|---|---|---|"]
    for layer, m in inv["matrices"].items():
        for which in ("raw", "half", "small"):
            for r in m[which]:
                lines.append(f"| `{layer}` | {which} | {r['p']} | {_fmt(r['norm_e'])} | {_fmt(r['lambda_n'])} | "
                             f"{_fmt(r['gap'])} | {_fmt(r['measured'])} | {_fmt(r['bound'])} | {_fmt(r['naive'])} |")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
