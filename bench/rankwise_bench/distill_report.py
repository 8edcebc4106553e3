"""``results.md`` and ``heldout_ppl.png`` of ``rankwise bench distill``."""
from __future__ import annotations

import math
from pathlib import Path

LABELS = {"lrc": "Low-Rank Clone, KL summed over the window (the code's batchmean), T = 40, SVD start (ours)",
          "lrc-normal": "LRC as above from the released code's N(0, 0.02) start",
          "minitron": "width-pruned by activation importance + logit KD (Minitron-style)",
          "scratch": "same shape from scratch (CE)",
          "lrc-noclone": "ablation: LRC without the clone terms (CE + KL)"}
UNITS = {"heldout_loss": "per token", "heldout_nats_per_byte": "per byte"}


def _nats(loss: float) -> str:
    return f"{loss:.3f}" if math.isfinite(loss) else "diverged"


def _extra(s: dict) -> str:
    """``" (+ 0.0003 for lrc, minitron)"``: the rates run beyond the grid, by rate."""
    by: dict[float, list[str]] = {}
    for row, lr in s.get("extra_lrs", ()):
        by.setdefault(lr, []).append(row)
    return "".join(f" (+ {lr:g} for {', '.join(rows)})" for lr, rows in by.items())


def _table(r: dict, key: str) -> list[str]:
    """One table: held-out loss (``key``: per token or per byte) of the teacher and of each row's
    best learning rate at every token budget."""
    budgets, t = [str(b) for b in r["sizes"]["budgets"]], r["teacher"]
    tokens = {str(k): v for k, v in r["tokens_per_budget"].items()}
    lines = [f"Held-out loss {UNITS[key]} (nats; lower is better):", "",
             "| row | student params | trained params | lr | start | " +
             " | ".join(f"{tokens[b]:,} tok" for b in budgets) + " |",
             "|---|---|---|---|---|" + "---|" * len(budgets),
             f"| teacher: the reference base (not trained here) | {t['params']:,} | 0 | - | {_nats(t[key])} | " +
             " | ".join("-" for _ in budgets) + " |"]
    for row, rec in r["best"].items():
        lines.append(f"| {row}: {LABELS[row]} | {rec['student_params']:,} | {rec['trainable_params']:,} | "
                     f"{rec['lr']:g} | {_nats(rec[key + '_at_0'])} | " +
                     " | ".join(_nats(rec[key].get(b, math.nan)) for b in budgets) + " |")
    return lines + [""]


def markdown(r: dict) -> str:
    """The results tables: held-out loss per token and per byte of each row's best learning
    rate at every token budget, with the teacher's and each row's starting point."""
    s, t, w = r["sizes"], r["teacher"], r["corpus"]["heldout_windows"]
    sh, budgets = t["shape"], [str(b) for b in r["sizes"]["budgets"]]
    lines = ["# bench distill: Low-Rank Clone vs scratch vs pruned + distilled, on the reference base", "",
             f"Teacher: `{t['path']}`, a Llama {sh['hidden']} x {sh['layers']} (heads {sh['heads']}, key/value "
             f"heads {sh['kv_heads']}, FFN {sh['intermediate']}, {'tied' if sh['tied'] else 'untied'} head), "
             f"{t['params']:,} parameters, SentencePiece vocabulary {sh['vocab']:,}, pretrained by rankwise on the "
             f"standard library and not trained here; held-out loss **{_nats(t['heldout_loss'])}** nats per token, "
             f"**{_nats(t['heldout_nats_per_byte'])}** per byte on {w['windows']} windows of {s['seq']} tokens "
             f"from held-out modules ({w['scored_tokens']:,} scored tokens, {w['scored_bytes']:,} bytes).",
             f"Students: hidden {s['student_hidden']} (teacher's depth, heads, head size, FFN, tied head); "
             f"batch {s['batch']} x {s['seq']} tokens of the training modules; AdamW, 10% warm-up then constant; "
             f"learning rate best of {tuple(s['lrs'])}{_extra(s)} by the final held-out loss. Python {r['python']}, "
             f"torch {r['torch']}, one thread, CPU. Quality only. Per byte = total nats / UTF-8 bytes of the "
             "scored tokens' text.", ""]
    lines += _table(r, "heldout_loss") + _table(r, "heldout_nats_per_byte")
    lines += ["`start` is before any student step (LRC: the SVD-initialised projections, lrc-normal: the random "
              "ones; minitron: the pruned teacher).", "",
              "Every learning rate (held-out loss per token / per byte at the last budget):", ""]
    for name, rec in r["pieces"].items():
        if name != "teacher":
            last = budgets[-1]
            lines.append(f"- {name}: {_nats(rec['heldout_loss'].get(last, math.nan))} / "
                         f"{_nats(rec['heldout_nats_per_byte'].get(last, math.nan))}"
                         + (f" (baked plain student: {_nats(rec['baked_heldout_loss'])} per token)"
                            if "baked_heldout_loss" in rec else ""))
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    """Held-out loss per byte against training tokens, one line per row, the teacher dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    budgets = [str(b) for b in r["sizes"]["budgets"]]
    xs = [b * r["sizes"]["batch"] * r["sizes"]["seq"] for b in r["sizes"]["budgets"]]
    for row, rec in r["best"].items():
        ys = [rec["heldout_nats_per_byte"].get(b, math.nan) for b in budgets]
        ax.plot(xs, ys, marker="o", label=f"{row} (lr {rec['lr']:g})")
    ax.axhline(r["teacher"]["heldout_nats_per_byte"], ls="--", c="gray", label="teacher (reference base)")
    ax.set_xscale("log")
    ax.set_xlabel("student training tokens")
    ax.set_ylabel("held-out loss per byte (nats)")
    ax.set_title("bench distill on the reference base")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
