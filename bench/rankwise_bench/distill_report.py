"""``results.md`` and ``heldout_ppl.png`` of ``rankwise bench distill``."""
from __future__ import annotations

import math
from pathlib import Path

LABELS = {"lrc": "Low-Rank Clone, KL summed over the window (the code's batchmean), T = 40, SVD start (ours)",
          "lrc-normal": "LRC as above from the released code's N(0, 0.02) start",
          "minitron": "width-pruned by activation importance + logit KD (Minitron-style)",
          "scratch": "same shape from scratch (CE)",
          "lrc-noclone": "ablation: LRC without the clone terms (CE + KL)",
          "lrc-token-t10": "earlier reading: KL averaged over tokens, T = 10",
          "lrc-token-t1": "earlier reading: KL averaged over tokens, T = 1",
          "lrc-token-noclone": "earlier reading: KL averaged over tokens, T = 10, no clone terms",
          "lrc-t1": "ablation: LRC with the KL at T = 1"}


def _ppl(loss: float) -> str:
    return f"{math.exp(loss):.3f}" if math.isfinite(loss) else "diverged"


def markdown(r: dict) -> str:
    """The results table: held-out perplexity per byte of each row's best learning rate at
    every token budget, with the teacher's and each row's starting point."""
    s, budgets = r["sizes"], [str(b) for b in r["sizes"]["budgets"]]
    lines = ["# bench distill: Low-Rank Clone vs scratch vs pruned + distilled", "",
             f"Teacher: byte-level Llama {s['hidden']}x{s['layers']} (heads {s['heads']}, FFN {s['intermediate']}), "
             f"{r['teacher']['params']:,} parameters, pretrained on {r['teacher']['tokens']:,} bytes of the "
             f"standard library; held-out perplexity per byte **{_ppl(r['teacher']['heldout_loss'])}** "
             f"on {s['eval_windows']} windows of {s['seq']} bytes from held-out modules.",
             f"Students: hidden {s['student_hidden']} (teacher's depth, heads, head size, FFN); "
             f"batch {s['batch']} x {s['seq']} bytes; AdamW, 10% warm-up then constant; learning rate "
             f"best of {tuple(s['lrs'])} by the final held-out loss. Python {r['python']}, torch {r['torch']}, "
             "one thread, CPU. Quality only.", "",
             "| row | student params | trained params | lr | start | " +
             " | ".join(f"{r['tokens_per_budget'][b] if b in r['tokens_per_budget'] else r['tokens_per_budget'][int(b)]:,} tok"
                        for b in budgets) + " |",
             "|---|---|---|---|---|" + "---|" * len(budgets)]
    for row, rec in r["best"].items():
        lines.append(f"| {row}: {LABELS[row]} | {rec['student_params']:,} | {rec['trainable_params']:,} | {rec['lr']:g} | "
                     f"{_ppl(rec['heldout_loss_at_0'])} | " +
                     " | ".join(_ppl(rec["heldout_loss"].get(b, math.nan)) for b in budgets) + " |")
    lines += ["", "Held-out perplexity per byte (lower is better); `start` is before any student step "
              "(LRC: the SVD-initialised projections, lrc-normal: the random ones; minitron: the pruned teacher).", "",
              "Every learning rate (held-out perplexity at the last budget):", ""]
    for name, rec in r["pieces"].items():
        if name != "teacher":
            lines.append(f"- {name}: {_ppl(rec['heldout_loss'].get(budgets[-1], math.nan))}"
                         + (f" (baked plain student: {_ppl(rec['baked_heldout_loss'])})" if "baked_heldout_loss" in rec else ""))
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    """Held-out perplexity against training tokens, one line per row, the teacher dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    budgets = [str(b) for b in r["sizes"]["budgets"]]
    xs = [b * r["sizes"]["batch"] * r["sizes"]["seq"] for b in r["sizes"]["budgets"]]
    for row, rec in r["best"].items():
        ys = [math.exp(rec["heldout_loss"][b]) if b in rec["heldout_loss"] else math.nan for b in budgets]
        ax.plot(xs, ys, marker="o", label=f"{row} (lr {rec['lr']:g})")
    ax.axhline(math.exp(r["teacher"]["heldout_loss"]), ls="--", c="gray", label="teacher")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("student training tokens (bytes)")
    ax.set_ylabel("held-out perplexity per byte")
    ax.set_title("bench distill")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
