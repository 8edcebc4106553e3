"""``bench compress``'s ``results.md`` and plot, rendered from its record alone (so the committed
Markdown regenerates: :mod:`rankwise_bench.regenerate`). Each model's section names the run that
measured it (a rerun of one model keeps the other's record)."""
from __future__ import annotations

from pathlib import Path

COLORS = {"none": "k", "magnitude": "tab:gray", "wanda": "tab:blue", "sparsegpt": "tab:orange",
          "3basil": "tab:red", "svd": "tab:brown", "rtn": "tab:purple", "gptq": "tab:green", "glvq": "tab:pink"}


def _table(rows: list[dict], causal: bool) -> str:
    """The rows of one model; a causal LM's quality is nats per byte, with the loss per token."""
    head = "nats / byte | loss / token | perplexity / token" if causal else "accuracy"
    lines = [f"| row | {head} | mean rel. error | max rel. error | params kept | compressed layers MiB | "
             "whole model MiB | compress s |", "|---|" + "---:|" * (9 if causal else 7)]
    for r in rows:
        q = (f"{r['quality']:.4f} | {r['eval_loss']:.4f} | {r['perplexity']:.3f}" if causal
             else f"{r['quality']:.2%}")
        lines.append(f"| {r['row']} | {q} | {r['rel_error_mean']:.4f} | {r['rel_error_max']:.4f} | "
                     f"{r['params'] / r['params_before']:.1%} | {r['target_bytes'] / 2**20:.3f} | "
                     f"{r['model_bytes'] / 2**20:.3f} | {r['compress_s']:.1f} |")
    return "\n".join(lines)


def _run_line(run: dict) -> str:
    models = ", ".join(run["sizes"]["models"])
    return (f"Python {run['python']}, torch {run['torch']}, {run['machine']}; wall {run['wall_s'] / 60:.1f} min "
            f"(models run: {models}). Produced by `{run['command']}`.")


def _minilm(res: dict) -> list[str]:
    s, i = res["run"]["sizes"], res["info"]
    return ["## MiniLM demo classifier (LoRA r=8 merged), accuracy on held-out docstrings", "",
            _run_line(res["run"]), "",
            f"{i['params']:,} parameters; trained {i['train']['steps']} steps x {i['train']['batch_size']} "
            f"({i['train_examples']} training / {i['eval_examples']} held-out docstrings); calibration "
            f"{s['calib_windows']} windows x {s['minilm_calib_length']} tokens of training docstrings.", "",
            _table(res["rows"], causal=False), ""]


def _base(res: dict) -> list[str]:
    s, i = res["run"]["sizes"], res["info"]
    sh, held, train = i["shape"], i["heldout_modules"], i["train_modules"]
    card = i.get("card_heldout")
    whole = (f" (its model card, over every held-out token in bfloat16: {card['loss_per_token']:.4f} nats per "
             f"token, {card['nats_per_byte']:.4f} per byte)" if card else "")
    md = ["## Reference base, loss per token and per byte on held-out modules", "",
          _run_line(res["run"]), "",
          f"Base `{i['base']}`: Llama {sh['layers']}x{sh['hidden']} ({sh['heads']} heads, {sh['kv_heads']} key/value "
          f"heads of {sh['head_dim']}, MLP {sh['intermediate']}, vocabulary {i['vocab']:,}, {i['params']:,} "
          f"parameters), loaded in float32, not trained here. Calibration: {s['calib_windows']} windows x "
          f"{s['llama_seq']} tokens evenly spaced over the {train['modules']} training modules; held-out: "
          f"{s['heldout_windows']} windows x {s['llama_seq']} tokens evenly spaced over the {held['modules']} "
          f"held-out modules (`BOS + module + EOS`, concatenated), {i['scored_tokens']:,} tokens scored = "
          f"{i['scored_bytes']:,} UTF-8 bytes ({i['scored_bytes'] / i['scored_tokens']:.2f} bytes per token). "
          f"Nats per byte = total nats / those bytes{whole}.", "",
          _table(res["rows"], causal=True), "",
          "### KV cache (dense model, token-by-token decoding)", "",
          "Nominal bits label the codes; stored bits per element include the float16 metadata "
          "(scales, shifts, minima).", "",
          "| cache | nominal bits | chunk | stored bits / element | nats / byte | loss / token | "
          "bytes / token (all layers, K+V) | vs float16 |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["kv_cache"]:
        md.append(f"| {r['kind']} | {r['bits']} | {r['chunk']} | {r['bits_per_element']:.2f} | "
                  f"{r['nats_per_byte']:.4f} | {r['eval_loss']:.4f} | {r['bytes_per_token']:.1f} | "
                  f"{r['bytes_per_token'] / r['fp16_bytes_per_token']:.3f} |")
    return md + [""]


def markdown(results: dict) -> str:
    """``results.md`` from the record."""
    md = ["# compress", "",
          "Each model's section names the run that measured it: `--set 'models=[llama]'` reruns one "
          "model and keeps the other's record.", ""]
    if "minilm" in results["models"]:
        md += _minilm(results["models"]["minilm"])
    if "llama" in results["models"]:
        md += _base(results["models"]["llama"])
    return "\n".join(md)


def plot(results: dict, path: Path) -> None:
    """Quality against bytes of the compressed layers, one panel per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [m for m in ("minilm", "llama") if m in results["models"]]
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        res = results["models"][name]
        for r in res["rows"]:
            ax.scatter(r["target_bytes"] / 2**20, r["quality"], c=COLORS.get(r["config"]["method"], "tab:cyan"), s=22)
            ax.annotate(r["row"], (r["target_bytes"] / 2**20, r["quality"]), fontsize=6, alpha=0.8)
        metric = res["metric"]
        title = "MiniLM classifier" if name == "minilm" else "reference base"
        ax.set(xlabel="bytes of the compressed layers (MiB)", ylabel=f"held-out {metric}",
               title=f"{title}: {metric} vs bytes" + (" (lower is better)" if name == "llama" else ""))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
