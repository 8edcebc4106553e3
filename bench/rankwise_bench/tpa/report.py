"""The table and the plot of ``bench tpa``."""
from __future__ import annotations

import math
from pathlib import Path


def table(result: dict) -> str:
    """One Markdown line per row."""
    lines = ["| row | best lr | heads (KV heads) | attention params / MHA's | held-out loss (nats/byte) | ppl/byte | "
             "KV cache B/token/layer, measured (Table 1 formula) | KV cache / MHA's | decode tok/s "
             "(median) | decode speed / MHA's (same round) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        loss = r["heldout_loss"]
        lines.append(
            f"| {name} | {r['lr']:g} | {r['heads']} ({r['kv_heads']}) | {r['attn_params'] / result['mha_attn_params']:.3f} | "
            f"{loss:.4f} | {math.exp(loss):.3f} | {r['kv_bytes_per_token_layer']:.0f} "
            f"({r['kv_formula_bytes']}) | {r['kv_ratio_to_mha']:.3f} | {r['decode_tok_s']:.0f} | "
            f"{r['decode_ratio_to_mha']:.2f} |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The whole ``results.md``."""
    s, info = result["sizes"], result["corpus"]
    head = (f"Llama-style {s['layers']} layers x width {s['hidden']} (MLP {s['intermediate']}, d_h "
            f"{s['head_dim']}), byte tokens, seq {s['seq']}, batch {s['batch']}, {s['steps']} AdamW steps "
            f"({s['steps'] * s['batch'] * s['seq']:,} training tokens per run), peak learning rates "
            f"{', '.join(f'{x:g}' for x in s['lrs'])} (each row's best by held-out loss; the others are in "
            f"results.json), TPA ranks R_Q={s['q_rank']}, R_K={s['k_rank']}, R_V={s['v_rank']}, GQA "
            f"{s['gqa_groups']} KV heads; corpus {info['bytes']['train']:,} train / "
            f"{info['bytes']['heldout']:,} held-out bytes of the Python {result['python']} standard library. "
            f"Decoding: {s['new_tokens']} greedy tokens after a {s['prompt']}-byte prompt with each "
            f"model's cache (MHA/GQA/MQA: transformers' Llama and DynamicCache; TPA: rankwise's "
            f"factorised cache), {s['decode_rounds']} interleaved rounds, fp32. {result['machine']}, "
            f"{s['threads']} thread(s), shared with other processes, torch {result['torch']}, wall "
            f"{result['wall_s']:.0f} s.\n")
    return "\n".join(["# tpa: Tensor Product Attention vs MHA, GQA, MQA at matched attention parameters\n",
                      head, table(result), ""])


def plot(result: dict, path: Path) -> None:
    """Training curves, and held-out loss against KV-cache bytes per token."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in result["rows"].items():
        c = torch.tensor(r["train_curve"])
        k = 10
        smooth = c.unfold(0, k, 1).mean(1) if len(c) > k else c
        a.plot(range(k - 1, k - 1 + len(smooth)), smooth.tolist(), label=name)
        b.scatter(r["kv_bytes_per_token_layer"], r["heldout_loss"])
        b.annotate(name, (r["kv_bytes_per_token_layer"], r["heldout_loss"]), fontsize=8)
    a.set(xlabel="step", ylabel="train loss (nats/byte, 10-step mean)", title="training at matched attention params")
    b.set(xlabel="KV cache bytes per token per layer (fp32)", ylabel="held-out loss (nats/byte)",
          title="quality vs cache")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["markdown", "plot", "table"]
