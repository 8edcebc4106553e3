"""``results.md`` and ``lambda.png`` of ``rankwise bench memory-decoder``, from its record alone."""
from __future__ import annotations

from pathlib import Path

from rankwise_bench.common import ordered

LABELS = {"memdec": "base + Memory Decoder", "dapt": "base + DAPT decoder", "knn": "kNN-LM"}


def plot(r: dict, path: Path) -> None:
    """Validation perplexity of each mixture by lambda, and the Memory Decoder's test sweep."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ev = r["eval"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in LABELS.items():
        curve = ev["validation ppl"][key]
        ax.plot([float(k) for k in curve], list(curve.values()), "o-", label=f"{label} (validation)")
    sweep = ev["test sweep (base + Memory Decoder, token ppl)"]
    ax.plot([float(k) for k in sweep], list(sweep.values()), "k--", label="base + Memory Decoder (test)")
    ax.set_xlabel("lambda")
    ax.set_ylabel("perplexity per token")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(r: dict) -> str:
    """``results.md`` from the record."""
    ev, sp, s = r["eval"], r["splits"], r["sizes"]
    mods = lambda k: ", ".join(f"`{m}`" for m in sp[k]["modules"])  # noqa: E731
    lines = ["# Memory Decoder vs DAPT, LoRA and kNN-LM on the reference base (one seed)", "",
             f"Base: `{r['base']}`, never trained. Domain: the {sum(len(v['modules']) for v in sp.values())} "
             "modules its pretraining held out, split by module: "
             + ", ".join(f"{k} {len(sp[k]['modules'])} modules ({sp[k]['tokens']:,} tokens, {sp[k]['bytes']:,} bytes)"
                         for k in ("train", "validation", "test", "general"))
             + f". Every model trains {s['steps']} steps x {s['batch']} windows of {s['seq']} tokens from the base; "
             f"datastore {r['knn']['datastore']:,} keys ({r['knn']['index']}), k={s['k']}, "
             f"T={r['knn']['temperature']:g} (chosen with kNN-LM's lambda on validation from "
             f"{', '.join(f'{t:g}' for t in s['temperatures'])}). Each lambda is chosen on the validation "
             f"modules from {r['lambda grid'][0]}..{r['lambda grid'][-1]}; never on test or general.", "",
             "| model | lambda | test ppl/token | test ppl/byte | general ppl/token | general ppl/byte |",
             "|---|---|---|---|---|---|"]
    for row in ev["rows"]:
        lam = "—" if row["lambda"] is None else f"{row['lambda']:g} ({row['chosen']})"
        t, g = row["test"], row["general"]
        lines.append(f"| {row['model']} | {lam} | {t['token_ppl']:.3f} | {t['byte_ppl']:.4f} | "
                     f"{g['token_ppl']:.3f} | {g['byte_ppl']:.4f} |")
    lines += ["", "Validation perplexity per token by lambda (the choice):"]
    for key, curve in ordered(ev["validation ppl"], LABELS).items():
        lines.append(f"- {LABELS[key]}: " + ", ".join(f"{k}: {v:.3f}" for k, v in curve.items())
                     + f" (chosen {ev['lambda'][key]})")
    best = sorted((float(t), min(c.values())) for t, c in r["knn"]["validation ppl"].items())
    lines += ["- kNN-LM's best validation ppl by T (at its best lambda): "
              + ", ".join(f"{t:g}: {v:.3f}" for t, v in best), "",
              "Test-set lambda sweep (diagnostic only, not used to choose; base + Memory Decoder, ppl per token): "
              + ", ".join(f"{k}: {v:.3f}" for k, v in ev["test sweep (base + Memory Decoder, token ppl)"].items()), "",
              f"Test modules: {mods('test')}. Validation: {mods('validation')}. General (out of the domain): "
              f"{mods('general')}. Training: {mods('train')}.", "",
              "Per byte = total nats / UTF-8 bytes of the modules' text. Wall time: "
              + ", ".join(f"{k} {r[k]['seconds']:.0f} s" for k in ("knn", "memdec", "dapt", "lora", "eval")) + ".",
              "", f"Command: `{r['command']}`", ""]
    return "\n".join(lines)


__all__ = ["markdown", "plot"]
