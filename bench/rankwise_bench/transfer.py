"""``rankwise bench transfer``: LoRASuite (``rankwise transfer``) on an upgraded model, against
retraining LoRA on the new model with the same small budget and with the full budget.

The models (both Llama, pretrained here on the Python standard library's own source,
:func:`rankwise_bench.corpus.load_corpus`'s training modules):

* old: a byte-level BPE tokenizer of :attr:`Sizes.old_vocab` entries trained with ``tokenizers``
  on the first ``old_mb`` MB of the corpus, a small Llama pretrained on that part;
* new: its own BPE tokenizer (``new_vocab``, trained on ``new_mb`` MB), a wider, deeper Llama
  with grouped-query attention, pretrained longer on more of the corpus.

The task is ``data.source: stdlib-functions`` (docstring -> ``def`` line), LoRA r 8 on
q/k/v/o. Rows, all on the new base and scored by its held-out completion loss (nats per token of
the new tokenizer; the old model's own loss is in another tokenizer and shown apart):

* ``new-base``: no adapter;
* ``lorasuite``: the old run transferred, no training;
* ``lorasuite-paper``: the same with the authors' unnormalised head maps;
* ``lorasuite+ft``: transferred, then ``small_steps`` of training (the paper's short fine-tune);
* ``lorasuite-paper+ft``: the paper's method as published: the authors' unnormalised head maps,
  then the same ``small_steps`` of training (issue 34);
* ``lora-small``: LoRA trained from its usual init for ``small_steps``;
* ``lora-full``: LoRA trained for ``full_steps`` (the old run's budget).

A control pair repeats the rows (``cont-*``) on the old model pretrained further
(``cont_steps`` on the next ``cont_mb`` MB): same tokenizer, width and depth, so ``W_x`` is the
identity and only the weights moved, the kind of upgrade where a transfer has most to keep.

Decision (issue 35 item 2): this benchmark keeps its own models by design. LoRASuite moves an
adapter from an *old* model to an *upgraded* one with another tokenizer, width and depth; the
reference base is one model, so at least the old side of the pair, of the same lineage and
corpus, has to be pretrained here (making the reference base the new side would still leave the
old one to build, and its control pair needs a continued pretraining of the old model).

Pieces (``pieces/<name>.json``, committed) are written as each finishes and skipped when present,
so an interrupted run resumes; models and runs live in ``_work/`` (not committed). Times are
those of one process on a shared CPU: compare ratios, not seconds.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rankwise.core import atomic
from rankwise_bench.common import write_results

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
EOS = "<|endoftext|>"


@dataclass
class Sizes:
    """The whole measurement's sizes (about 10 minutes of one CPU core)."""
    seq: int = 128
    batch: int = 16
    old_mb: float = 1.5
    old_vocab: int = 512
    old_hidden: int = 64
    old_layers: int = 2
    old_heads: int = 4
    old_steps: int = 300
    new_mb: float = 4.0
    new_vocab: int = 1024
    new_hidden: int = 96
    new_layers: int = 4
    new_heads: int = 6
    new_kv_heads: int = 2
    new_steps: int = 700
    pretrain_lr: float = 3e-3
    eval_windows: int = 64
    r: int = 8
    lora_lr: float = 2e-3
    full_steps: int = 120
    small_steps: int = 15
    cont_mb: float = 1.5
    cont_steps: int = 300
    seed: int = 0


def _piece(out: Path, name: str, fn) -> dict:
    """``pieces/name.json`` if written, else ``fn()`` written there."""
    path = out / "pieces" / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    began = time.perf_counter()
    record = fn()
    record["piece_wall_s"] = round(time.perf_counter() - began, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, record)
    return record


def train_tokenizer(text: str, vocab: int):
    """A byte-level BPE tokenizer of ``vocab`` entries trained on ``text`` (``tokenizers``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = text.splitlines(keepends=True)
    raw.train_from_iterator(("".join(lines[i:i + 200]) for i in range(0, len(lines), 200)), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOS, pad_token=EOS, bos_token=EOS)


def _pretrain(s: Sizes, folder: Path, mb: float, vocab: int, hidden: int, layers: int, heads: int,
              kv_heads: int, steps: int, start: Path | None = None) -> dict:
    """Tokenizer + Llama pretrained on the first ``mb`` MB of the corpus; saved in ``folder``.
    With ``start`` (a model folder): that model and its tokenizer pretrained further on the
    ``mb`` MB that follow the first ``s.old_mb``."""
    from transformers import LlamaForCausalLM

    from rankwise.engine import Engine, evaluate, get_task, linear_schedule
    from rankwise_bench.common import llama
    from rankwise_bench.corpus import ByteWindows, load_corpus
    train_bytes, held_bytes, info = load_corpus()
    first = int(s.old_mb * 2 ** 20) if start is not None else 0
    text = bytes(train_bytes[first: first + int(mb * 2 ** 20)].tolist()).decode("utf-8", errors="replace")
    began = time.perf_counter()
    if start is not None:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(start)
    else:
        tok = train_tokenizer(text, vocab)
    tokenizer_s = time.perf_counter() - began
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.int64)
    held_text = bytes(held_bytes[: 2 ** 19].tolist()).decode("utf-8", errors="replace")
    held = torch.tensor(tok(held_text)["input_ids"], dtype=torch.int64)
    g = torch.Generator().manual_seed(s.seed)
    starts = torch.randint(0, ids.numel() - s.seq, (steps, s.batch), generator=g)
    train = ByteWindows(ids, starts, s.seq)
    heldout = ByteWindows(held, torch.randint(0, held.numel() - s.seq, (s.eval_windows,), generator=g), s.seq)
    train.pad_id = heldout.pad_id = tok.pad_token_id
    if start is None:
        model = llama(len(tok), hidden, layers, heads, hidden * 8 // 3, kv_heads=kv_heads, positions=256,
                      seed=s.seed, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    else:
        torch.manual_seed(s.seed)
        model = LlamaForCausalLM.from_pretrained(start)
    task = get_task("causal-lm")
    opt = torch.optim.AdamW(model.parameters(), lr=s.pretrain_lr, weight_decay=0.0)
    engine = Engine(model, task, opt, train, s.batch, seed=s.seed, scheduler=linear_schedule(opt, steps, 0.05))
    began = time.perf_counter()
    engine.fit(steps)
    train_s = time.perf_counter() - began
    loss = evaluate(model, task, heldout, 32)["eval_loss"]
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return {"corpus_mb": mb, "tokens": int(ids.numel()), "bytes_per_token": round(len(text.encode()) / ids.numel(), 3),
            "vocab": len(tok), "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
            "params": sum(p.numel() for p in model.parameters()), "steps": steps,
            "heldout_loss": round(loss, 4), "tokenizer_s": round(tokenizer_s, 1), "train_s": round(train_s, 1),
            "corpus": info}


def lora_config(s: Sizes, base: Path, steps: int) -> dict:
    """The task's run config: stdlib-functions, LoRA r on q/k/v/o, AdamW."""
    return {"model": {"path": str(base)}, "task": {"name": "causal-lm"},
            "data": {"source": "stdlib-functions", "format": "prompt-completion", "max_length": 96,
                     "packing": True},
            "method": {"name": "lora", "r": s.r, "alpha": 2 * s.r, "targets": TARGETS},
            "optim": {"name": "adamw", "lr": s.lora_lr},
            "train": {"steps": steps, "batch_size": s.batch, "eval_batch_size": 64, "seed": s.seed,
                      "progress": False, "threads": 1}}


def _train(s: Sizes, base: Path, steps: int, out: Path) -> dict:
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.train import train
    metrics = train(build_run_config(lora_config(s, base, steps)), out, summary=False)
    return {k: metrics[k] for k in ("eval_loss", "steps", "train_time_s", "peak_memory_mb",
                                    "memory_meter", "trainable_params")}


def _base_only(s: Sizes, base: Path) -> dict:
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.session import prepare
    session = prepare(build_run_config(lora_config(s, base, 1)))  # B = 0: the base's outputs
    return {"eval_loss": round(session.evaluate()["eval_loss"], 6), "steps": 0}


def _transfer(run: Path, base: Path, out: Path, steps: int, normalise: bool = True) -> dict:
    from rankwise.commands.transfer.run import TransferConfig, transfer_run
    rec = transfer_run(run, str(base), out, TransferConfig(finetune_steps=steps, normalise=normalise))
    m = rec["metrics"]
    return {"eval_loss": m["eval_loss"], "steps": m["steps"], "transfer_s": rec["transfer_s"], "load_s": rec["load_s"],
            "transfer_peak_memory_mb": rec["transfer_peak_memory_mb"],
            "train_time_s": m.get("train_time_s", 0.0), "peak_memory_mb": m.get("peak_memory_mb"),
            "memory_meter": rec["memory_meter"], "w_x": rec["w_x"], "layer_mapping": rec["layer_mapping"],
            "cka": rec["cka"], "head_mapping": rec["head_mapping"], "not_transferred": rec["not_transferred"]}


ROWS = ("new-base", "lorasuite", "lorasuite-paper", "lorasuite+ft", "lorasuite-paper+ft", "lora-small",
        "lora-full")
# models a later piece needs: (piece that builds it, folder); rebuilt if _work/ was cleared
NEEDS = {"lorasuite-paper+ft": ("old-base", "new-base", "lora-old"),
         "cont-lorasuite-paper+ft": ("old-base", "lora-old", "cont-base")}


def run(out: Path, s: Sizes | None = None) -> dict:
    """Every piece not yet recorded, then ``results.json`` and ``results.md``."""
    s = s or Sizes()
    out = Path(out)
    work = out / "_work"
    work.mkdir(parents=True, exist_ok=True)
    old_base, new_base, old_run = work / "old-base", work / "new-base", work / "lora-old"
    cont_base = work / "cont-base"
    pieces = {
        "old-base": lambda: _pretrain(s, old_base, s.old_mb, s.old_vocab, s.old_hidden, s.old_layers,
                                      s.old_heads, s.old_heads, s.old_steps),
        "new-base": lambda: _pretrain(s, new_base, s.new_mb, s.new_vocab, s.new_hidden, s.new_layers,
                                      s.new_heads, s.new_kv_heads, s.new_steps),
        "lora-old": lambda: _train(s, old_base, s.full_steps, old_run),
        "new-base-eval": lambda: _base_only(s, new_base),
        "lorasuite": lambda: _transfer(old_run, new_base, work / "lorasuite", 0),
        "lorasuite-paper": lambda: _transfer(old_run, new_base, work / "lorasuite-paper", 0, normalise=False),
        "lorasuite+ft": lambda: _transfer(old_run, new_base, work / "lorasuite-ft", s.small_steps),
        "lora-small": lambda: _train(s, new_base, s.small_steps, work / "lora-small"),
        "lora-full": lambda: _train(s, new_base, s.full_steps, work / "lora-full"),
        # the control pair: the old model pretrained further (same tokenizer, width and depth)
        "cont-base": lambda: _pretrain(s, cont_base, s.cont_mb, s.old_vocab, s.old_hidden, s.old_layers,
                                       s.old_heads, s.old_heads, s.cont_steps, start=old_base),
        "cont-base-eval": lambda: _base_only(s, cont_base),
        "cont-lorasuite": lambda: _transfer(old_run, cont_base, work / "cont-lorasuite", 0),
        "cont-lorasuite-paper": lambda: _transfer(old_run, cont_base, work / "cont-lorasuite-paper", 0,
                                                  normalise=False),
        "cont-lorasuite+ft": lambda: _transfer(old_run, cont_base, work / "cont-lorasuite-ft", s.small_steps),
        "cont-lora-small": lambda: _train(s, cont_base, s.small_steps, work / "cont-lora-small"),
        "cont-lora-full": lambda: _train(s, cont_base, s.full_steps, work / "cont-lora-full"),
        # issue 34: the paper's formula with its fine-tune (control first: it needs no new-base)
        "cont-lorasuite-paper+ft": lambda: _transfer(old_run, cont_base, work / "cont-lorasuite-paper-ft",
                                                     s.small_steps, normalise=False),
        "lorasuite-paper+ft": lambda: _transfer(old_run, new_base, work / "lorasuite-paper-ft", s.small_steps,
                                                normalise=False),
    }
    for name, piece in pieces.items():  # a half-written folder of an interrupted piece goes first
        if not (out / "pieces" / f"{name}.json").is_file():
            _clear(work, name)
    records, rebuilt = {}, {}
    for name, fn in pieces.items():
        if not (out / "pieces" / f"{name}.json").is_file():
            for need in NEEDS.get(name, ()):
                if not (work / need).is_dir():  # a model of a recorded piece, gone with _work/
                    again = pieces[need]()
                    key = "heldout_loss" if "heldout_loss" in again else "eval_loss"
                    rebuilt[need] = {"recorded": records[need][key], "rebuilt": again[key]}
        records[name] = _piece(out, name, fn)
    prior = json.loads((out / "results.json").read_text()).get("rebuilt", {}) \
        if (out / "results.json").is_file() else {}
    result = {"sizes": asdict(s), "pieces": records, "torch": torch.__version__,
              **({"rebuilt": {**prior, **rebuilt}} if prior or rebuilt else {})}
    write_results(out, result, markdown(result))
    return result


def _clear(work: Path, name: str) -> None:
    import shutil
    folder = name.replace("+", "-") if not name.endswith("-eval") else None
    if folder and (work / folder).exists():
        shutil.rmtree(work / folder)


def markdown(result: dict) -> str:
    """``results.md`` from the record: the two tables of the pieces."""
    r, s = result["pieces"], result["sizes"]
    old, new = r["old-base"], r["new-base"]
    full = r["lora-full"]
    lines = ["# transfer: LoRASuite onto an upgraded model\n",
             f"old base: Llama {old['hidden']} wide, {old['layers']} layers, {old['heads']} heads, BPE "
             f"{old['vocab']}, {old['params']:,} parameters, {old['steps']} steps on {old['corpus_mb']} MB "
             f"(held-out corpus loss {old['heldout_loss']}).  ",
             f"new base: Llama {new['hidden']} wide, {new['layers']} layers, {new['heads']} heads / "
             f"{new['kv_heads']} KV heads, its own BPE {new['vocab']}, {new['params']:,} parameters, "
             f"{new['steps']} steps on {new['corpus_mb']} MB (held-out corpus loss {new['heldout_loss']}).  ",
             f"Task stdlib-functions, LoRA r {s['r']} on q/k/v/o. The old run ({s['full_steps']} steps) reaches "
             f"held-out loss {r['lora-old']['eval_loss']:.4f} in the old tokenizer (not comparable with "
             "the rows below).\n",
             f"W_x: {r['lorasuite']['w_x']}; layer mapping (old -> new) {r['lorasuite']['layer_mapping']}.\n",
             _table(r, ""),
             "\nControl pair: the old model pretrained further "
             f"({r['cont-base']['steps']} steps on the next {r['cont-base']['corpus_mb']} MB; held-out corpus "
             f"loss {old['heldout_loss']} -> {r['cont-base']['heldout_loss']}): same tokenizer, width and "
             f"depth, so W_x = I ({r['cont-lorasuite']['w_x']['kind']}); layer mapping "
             f"{r['cont-lorasuite']['layer_mapping']}.\n",
             _table(r, "cont-")]
    if result.get("rebuilt"):
        lines.append("\nModels rebuilt from their seeds for the `*-paper+ft` rows (issue 34; _work/ had been "
                     "cleared), recorded vs rebuilt loss: " + "; ".join(
                         f"{k} {v['recorded']:.4f} vs {v['rebuilt']:.4f}" for k, v in result["rebuilt"].items()) + ".")
    lines.append("\nTimes: one process per piece on a shared CPU (single thread); compare ratios. "
                 "transfer s: W_x, the CKA forwards, the mappings and the per-head maths (loading the "
                 "models and data not counted, as a retraining's data preparation is not). Peak memory: "
                 f"{full['memory_meter']} (training: the run's own meter; transfer: its computation).")
    return "\n".join(lines) + "\n"


def _table(r: dict, p: str) -> str:
    full = r[f"{p}lora-full"]
    rows = {f"{p}new-base" if not p else "cont-base": r[f"{p}new-base-eval" if not p else "cont-base-eval"],
            **{p + k: r[p + k] for k in ROWS[1:] if p + k in r}}  # a row added later: once measured
    lines = ["| row | steps on the new base | held-out loss | train s | transfer s | total s vs lora-full | peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for name, m in rows.items():
        total = m.get("train_time_s", 0.0) + m.get("transfer_s", 0.0)
        base = name.endswith("base")
        ratio = f"{total / full['train_time_s']:.2f}" if not base else "-"
        peak = max(x for x in (m.get("peak_memory_mb"), m.get("transfer_peak_memory_mb")) if x is not None) \
            if not base else None
        lines.append(f"| {name} | {m['steps']} | {m['eval_loss']:.4f} | {m.get('train_time_s', 0.0):.1f} | "
                     f"{m.get('transfer_s', 0.0):.1f} | {ratio} | {'-' if peak is None else f'{peak:.0f}'} |")
    return "\n".join(lines)


__all__ = ["ROWS", "Sizes", "lora_config", "markdown", "run", "train_tokenizer"]
