"""Write the reference base from its pretraining run: ``bench/reference-base/model/``.

    python bench/reference-base/card.py RUN_DIR [OUT_DIR]

Copies the run's model as bfloat16 safetensors with its tokenizer (``tokenizer.model``
included), then measures it *through plain transformers* (``AutoModelForCausalLM`` +
``AutoTokenizer``, nothing of rankwise) on the held-out standard-library modules, draws the loss
curve and writes the model card (``README.md``) with the numbers. ``make reference-base`` runs
the pretraining and then this.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
PROMPTS = ["import os\nimport sys\n\n\ndef ", "class Stack:\n    \"\"\"A last-in, first-out list.\"\"\"\n\n    def ",
           "    def __repr__(self):\n        return ", "# Copyright (C) 2001 Python Software Foundation\n"]


def heldout_loss(model, tok, seq: int) -> dict:
    """Summed next-token loss over every held-out module, in consecutive ``seq``-token windows
    (``BOS + text + EOS``, as the run's ``data.split_long`` cut them), per token and per byte."""
    from rankwise.data.corpus import load_source_records
    nll, tokens, text_bytes, modules = 0.0, 0, 0, 0
    model.eval()
    for rec in load_source_records():
        if not rec["heldout"]:
            continue
        ids = [tok.bos_token_id] + tok(rec["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        for start in range(0, len(ids), seq):
            window = torch.tensor([ids[start:start + seq]])
            if window.shape[1] < 2:
                continue
            with torch.no_grad():
                logits = model(input_ids=window).logits.float()  # (1, T, V)
            nll += torch.nn.functional.cross_entropy(logits[0, :-1], window[0, 1:], reduction="sum").item()
            tokens += window.shape[1] - 1
        text_bytes += len(rec["text"].encode("utf-8"))
        modules += 1
    return {"modules": modules, "tokens": tokens, "bytes": text_bytes, "loss_per_token": nll / tokens,
            "nats_per_byte": nll / text_bytes, "bits_per_byte": nll / text_bytes / math.log(2)}


def completions(model, tok, new_tokens: int = 40) -> list[tuple[str, str]]:
    """Greedy continuations of :data:`PROMPTS`."""
    out = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        out.append((prompt, tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)))
    return out


def plot(events: list[dict], path: Path) -> None:
    """Training loss (every logged step) and held-out loss (each evaluation) against tokens."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    train = [(e["step"], e["loss"]) for e in events if "loss" in e]
    held = [(e["step"], e["eval_loss"]) for e in events if "eval_loss" in e]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*zip(*train), lw=1, label="training loss")
    ax.plot(*zip(*held), "o-", label="held-out modules")
    ax.set_xlabel("step (32 x 256 tokens)")
    ax.set_ylabel("nats / token")
    ax.set_ylim(top=min(8.0, max(v for _, v in train)))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(run: Path, out: Path) -> dict:
    """Export, measure and describe the reference base; return the card's numbers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    if out.exists():
        shutil.rmtree(out)
    model = AutoModelForCausalLM.from_pretrained(str(run / "model"), dtype=torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    for f in (run / "model").iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)  # what users load
    tok = AutoTokenizer.from_pretrained(str(out))
    seq = cfg["data"]["max_length"]
    held = heldout_loss(model, tok, seq)
    data = next(e for e in events if e.get("event") == "data")
    t = cfg["train"]
    seen = int(t["steps"] * t["batch_size"] * seq * data.get("packing_efficiency", 1.0))
    numbers = {"parameters": model.num_parameters(), "vocab_size": len(tok), "steps": t["steps"],
               "tokens_seen": seen, "train_time_s": metrics["train_time_s"],
               "run_eval_loss": metrics["eval_loss"], "heldout": held,
               "python": ".".join(map(str, sys.version_info[:3]))}
    (out / "card.json").write_text(json.dumps(numbers, indent=2) + "\n")
    plot(events, out / "loss.png")
    samples = completions(model, tok)
    (out / "README.md").write_text(card(cfg, numbers, samples, data))
    return numbers


def card(cfg: dict, n: dict, samples: list[tuple[str, str]], data: dict) -> str:
    """The model card's Markdown."""
    h = n["heldout"]
    m = json.loads((HERE / "config" / "config.json").read_text())
    lines = [
        "# rankwise reference base (stdlib-llama-6m)",
        "",
        "A small Llama-architecture causal LM pretrained **from random weights** by rankwise itself,",
        "on the Python standard library's source code, comments and docstrings. The benchmarks'",
        "causal-LM rows start from it, so their claims are measured on a model that has learned",
        "something instead of on random weights. Plain transformers loads it:",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("bench/reference-base/model")',
        'tok = AutoTokenizer.from_pretrained("bench/reference-base/model")',
        "```",
        "",
        "## How it was made",
        "",
        "```",
        "make reference-base",
        "# = rankwise train bench/reference-base/pretrain.yaml --resume --out runs/reference-base",
        "#   python bench/reference-base/card.py runs/reference-base bench/reference-base/model",
        "```",
        "",
        f"- Architecture: Llama, {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
        f"{m['num_attention_heads']} heads ({m['num_key_value_heads']} key/value heads), MLP "
        f"{m['intermediate_size']}, tied embeddings, RoPE; {n['parameters']:,} parameters "
        "(`bench/reference-base/config/config.json`, weights stored in bfloat16).",
        f"- Tokenizer: SentencePiece BPE of {n['vocab_size']:,} tokens learned from the training "
        "split by the same run (`model.train_tokenizer`): Llama-2 layout, byte fallback, digits "
        "split, whitespace kept; `tokenizer.model` ships beside `tokenizer.json`.",
        f"- Data: `data.source: stdlib-source` of Python {n['python']}: one text per module "
        f"(tests and idlelib left out), {data['train_examples']:,} training windows of "
        f"{cfg['data']['max_length']} tokens (`data.split_long`, packed); whole modules are held "
        "out (`crc32(module) % 10 == 0`).",
        f"- Training: AdamW (lr {cfg['optim']['lr']}, betas {cfg['optim']['betas']}, weight decay "
        f"{cfg['optim']['weight_decay']}), {n['steps']:,} steps of {cfg['train']['batch_size']} "
        f"blocks, bf16 autocast, one CPU thread: **{n['tokens_seen'] / 1e6:.1f}M tokens seen** in "
        f"{n['train_time_s'] / 3600:.1f} h.",
        "",
        "## Held-out quality",
        "",
        f"On the {h['modules']} held-out modules ({h['bytes']:,} bytes, {h['tokens']:,} tokens), "
        "measured through plain transformers in the stored bfloat16 weights:",
        "",
        "| loss per token (nats) | loss per byte (nats) | bits per byte |",
        "|---|---|---|",
        f"| {h['loss_per_token']:.4f} | {h['nats_per_byte']:.4f} | {h['bits_per_byte']:.4f} |",
        "",
        f"(The run's own last evaluation, in float32 master weights: {n['run_eval_loss']:.4f} nats per "
        "token. A uniform guess over the vocabulary is "
        f"{math.log(n['vocab_size']):.2f} nats per token.)",
        "",
        "![loss curve](loss.png)",
        "",
        "## Greedy completions",
        "",
    ]
    for prompt, text in samples:
        lines += ["```python", prompt + text, "```", ""]
    lines += [
        "## License",
        "",
        "The training text is the Python standard library's, © Python Software Foundation, under",
        "the PSF License Agreement (`LICENSE.txt` of the Python installation), which permits",
        "derivative works. The weights and tokenizer are released with rankwise under Apache-2.0.",
        "It is a research fixture for measuring training methods, not a code assistant.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE / "model"
    print(json.dumps(write(run_dir, target), indent=2))
