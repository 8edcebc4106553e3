"""The tables and the plot of ``lowrank-pretrain``."""
from __future__ import annotations

import math
from pathlib import Path

import torch


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.3f}"


def _peak(r: dict) -> str:
    p = r.get("peak_mib")
    if p is None:
        return "n/a"
    return f"{p['total']:.2f}" if p.get("optimizer") is None else f"{p['total']:.2f} ({p['optimizer']:.2f})"


def table(best: dict, ratios: dict, rank: int) -> str:
    """The Markdown results table, one line per row at its best learning rate."""
    lines = ["| optimizer | best lr | held-out loss (nats/byte) | ppl/byte | loss after rank-"
             f"{rank} truncation | state MiB counted | state MiB formula | params+grads+state MiB | "
             "peak MiB, shared meter (optimizer's share) | "
             "step time / AdamW, measured | step time / AdamW, common fwd+bwd | optimizer.step / "
             "AdamW's | slowest optimizer.step ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in best.items():
        trunc = r.get("heldout_loss_truncated")
        total = r["param_bytes"] + r["grad_bytes"] + r["state_bytes"]
        loss = r["heldout_loss"]
        lines.append(
            f"| {m} | {r['lr']:g} | {loss:.4f} | {math.exp(loss) if math.isfinite(loss) else float('nan'):.3f} | "
            f"{'' if trunc is None else f'{trunc:.4f}'} | {r['state_bytes'] / 2**20:.3f} | "
            f"{_mib(r['formula_bytes'])} | {total / 2**20:.2f} | "
            f"{_peak(r)} | {ratios[m]['step']:.2f} | "
            f"{ratios[m]['step_common_fb']:.2f} | {ratios[m]['opt_step']:.2f} | "
            f"{ratios[m]['refresh_step_ms']:.0f} |")
    return "\n".join(lines)


def plot(best: dict, runs: list[dict], path: Path) -> None:
    """Loss curves at each row's best learning rate, and held-out loss over the sweep."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for m, r in best.items():
        c = torch.tensor(r["train_curve"])
        k = 10
        smooth = c.unfold(0, k, 1).mean(1) if len(c) > k else c
        a.plot(range(k - 1, k - 1 + len(smooth)), smooth.tolist(), label=f"{m} (lr {r['lr']:g})")
        pts = sorted((x["lr"], x["heldout_loss"]) for x in runs if x["method"] == m)
        b.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    a.set(xlabel="step", ylabel="train loss (nats/byte, 10-step mean)", title="best learning rate per optimizer")
    b.set(xscale="log", xlabel="learning rate (NGN-M: c)", ylabel="held-out loss", title="learning-rate sweep")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict) -> str:
    """The whole ``results.md`` from the record: one line of setup, then :func:`table` of each
    row at its best learning rate (``result["best"]``)."""
    info, s = result["corpus"], result["sizes"]
    head = (f"Llama {s['layers']}x{s['hidden']} (intermediate {s['intermediate']}, {result['model_params']:,} "
            f"params), byte tokens, seq {s['seq']}, batch {s['batch']}, {s['steps']} steps, rank {s['rank']}, "
            f"refresh every {s['update_every']}, {s['precision']} on {s['device']}; corpus "
            f"{info['bytes']['train']:,} train / {info['bytes']['heldout']:,} held-out bytes of the Python "
            f"{result['python']} standard library. {result['machine']}, {s['threads']} thread(s), torch "
            f"{result['torch']}, wall {result['wall_s']:.0f} s.\n")
    return "\n".join(["# lowrank-pretrain\n", head,
                      table(result["best"], result["step_time_ratio_to_adamw"], s["rank"]), ""])
