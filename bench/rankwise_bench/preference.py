"""Benchmark: SFT, question-free fine-tuning (QFFT) and DPO on a verifiable task, on the
reference base (``rankwise bench preference``; issue 36 item 2, quality only;
``docs/preference-rl.md``).

Decision (issue 36 item 2): the claims need a causal LM that has learned something, so the
benchmark starts from the reference base (:func:`rankwise_bench.common.reference_base`, a
6.45M-parameter Llama pretrained on the standard library, float32, with its own SentencePiece
tokenizer). The random-weight 4-layer Llama with the MiniLM tokenizer is gone, and so is its
workaround, training the final RMSNorm's weight beside LoRA: there the frozen random head capped
every logit at ~2.6 and LoRA alone left the loss near ln(30k) (9.2 after 150 steps); the
base's head is trained, and LoRA alone takes the completion loss from 3.8-4.5 to 0.9-1.1 nats
per token in the 150 SFT steps (the committed seeds), so every row now trains the LoRA weights
only, as ``rankwise train`` does.

Task: the ``stdlib-functions`` records (prompt: the first ``PROMPT_WORDS`` words of a
standard-library function's docstring; response: its ``def`` line), encoded as ``rankwise
train`` encodes ``data.format: prompt-completion`` (``BOS + prompt + response + EOS``, loss on
the response + EOS; the encoding of ``examples/compare-reference.yaml``, whose prompts are whole
docstrings: cut here to the 32 words of ``bench grpo-gain``). ``TRAIN + HELD_OUT`` records are
every k-th one (spread over the packages); every 5th of them is held out (512 training, 128 held out). Reward:
:func:`rankwise.data.instruct.def_line_reward` (1 when the completion's first line parses as a
``def`` line naming the record's function). All rows train through
:class:`rankwise.engine.Engine` with AdamW, gradient clip 1:

* **SFT**: LoRA r=8, alpha 16 on every linear layer (``compare-reference``'s LoRA row),
  ``SFT_STEPS`` steps of ``SFT_BATCH``, lr ``SFT_LR``, on the training records.
* **QFFT**: the same LoRA, steps and seed on the responses alone (``data.question_free``'s
  encoding, :class:`rankwise.data.formats.Encoder`, at its default ``question_free_eos: false``,
  the released template: no EOS after a response), never seeing a question.
* **DPO**: the SFT adapter merged into the base (so "adapters off" is the SFT model), then a
  fresh LoRA (r=8) trained with the ``dpo`` task (sigmoid loss, ``BETA``, reference
  ``adapters-off``) on pairs sampled from the SFT model: for each training prompt, ``SAMPLES``
  completions at ``TEMPERATURE`` (0.7, as ``bench grpo-gain``); chosen = a rewarded one,
  rejected = an unrewarded one (a prompt whose samples are all rewarded, or none, gives no pair).
  Its learning rate and steps were fixed before the runs, not chosen on validation.

Each model (and the base, for reference: scored with the first seed and copied, as greedy
decoding of the same weights does not depend on the seed) answers every training prompt and
every held-out prompt greedily (KV cache, at most ``NEW_TOKENS`` new tokens); reported: mean reward (accuracy) and mean
response length in tokens, per seed and mean ± std. The seed sets the LoRA initialisations, the
batch order and the sampling; the base weights are the same. One record per seed
(``seed-N.json``); a run computes the seeds not yet recorded and rewrites the tables.
"""
from __future__ import annotations

import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from rankwise.core import atomic
from rankwise_bench.common import reference_base, write_results

SEEDS = (0, 1, 2)
TRAIN, HELD_OUT, PROMPT_WORDS = 512, 128, 32
MAX_LEN, NEW_TOKENS = 96, 32
R, ALPHA, TARGETS = 8, 16.0, "all-linear"
SFT_STEPS, SFT_BATCH, SFT_LR = 150, 16, 2e-3
SAMPLES, TEMPERATURE, DPO_STEPS, DPO_BATCH, DPO_LR, BETA, DPO_R = 8, 0.7, 60, 8, 5e-4, 0.1, 8
QFFT_EOS = False   # data.question_free_eos's default: the released template ends no response with EOS
METHODS = ("base", "sft", "qfft", "dpo")
COMMAND = "OMP_NUM_THREADS=1 flock /tmp/core2.lock rankwise bench preference --out bench/results/preference"


def records() -> tuple[list[dict], list[dict]]:
    """``(training, held-out)`` records: ``TRAIN + HELD_OUT`` stdlib functions, every k-th
    (so both sets span the packages), every n-th of them held out (n = 5 at 512 + 128);
    docstrings cut to their first ``PROMPT_WORDS`` words."""
    from rankwise.data.instruct import load_function_records
    recs = [{"prompt": " ".join(r["prompt"].split()[:PROMPT_WORDS]) + "\n", "completion": r["completion"],
             "id": r["id"]} for r in load_function_records()]
    step, n = max(1, len(recs) // (TRAIN + HELD_OUT)), (TRAIN + HELD_OUT) // HELD_OUT
    picked = recs[::step][:TRAIN + HELD_OUT]
    return ([r for k, r in enumerate(picked) if k % n][:TRAIN],
            [r for k, r in enumerate(picked) if k % n == 0][:HELD_OUT])


class Examples(list):
    """Token examples with the ``pad_id`` the engine reads."""

    def __init__(self, items: list[dict], pad_id: int) -> None:
        super().__init__(items)
        self.pad_id = pad_id


def encode(tok, recs: list[dict], question_free: bool) -> Examples:
    """SFT (``question_free=False``) or QFFT training examples, as ``rankwise train`` builds them
    (``data.format: prompt-completion``; QFFT with ``data.question_free_eos: QFFT_EOS``)."""
    from rankwise.data.formats import Encoder
    enc = Encoder(tok, "prompt-completion", MAX_LEN, question_free=question_free,
                  question_free_eos=QFFT_EOS)
    out = enc({"prompt": [r["prompt"] for r in recs], "completion": [r["completion"] for r in recs]},
              list(range(len(recs))))
    return Examples([{"input_ids": i, "labels": lab} for i, lab in zip(out["input_ids"], out["labels"]) if i],
                    tok.pad_token_id)


def load_base(folder: Path | None = None):
    """``(model, tokenizer)``: the reference base (or the base in ``folder``), float32, the
    tokenizer as ``rankwise train`` loads it (pad = EOS where it has none)."""
    from transformers import AutoModelForCausalLM

    from rankwise.recipes.model import load_tokenizer
    folder = Path(folder) if folder else reference_base()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), load_tokenizer(str(folder))


def add_lora(model, r: int, seed: int):
    """LoRA r (alpha 2r) on ``TARGETS``, initialised from ``seed``; the model in train mode."""
    from rankwise.adapters.lora import LoraConfig, apply_lora
    torch.manual_seed(1000 + seed)
    apply_lora(model, LoraConfig(r=r, alpha=2.0 * r, targets=TARGETS, dropout=0.0))
    return model.train()


def fit(model, task, data, steps: int, batch: int, lr: float, seed: int) -> list[float]:
    """``steps`` engine steps of AdamW on the trainable (adapter) weights; the losses."""
    from rankwise.engine import Engine
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    engine = Engine(model, task, opt, data, batch, seed=seed, grad_clip=1.0)
    return [engine.train_step(k).loss for k in range(steps)]


@torch.no_grad()
def answer(model, tok, prompts: list[str], temperature: float = 0.0, seed: int = 0,
           batch: int = 32) -> list[list[int]]:
    """New token ids (without EOS) for each prompt, asked as in training (``prefix + prompt``),
    greedy or sampled, batched with left padding and the KV cache."""
    from rankwise.data.formats import Encoder, end_id
    enc = Encoder(tok, "prompt-completion", MAX_LEN)
    eos, pad = end_id(tok), tok.pad_token_id
    model.eval()
    torch.manual_seed(5000 + seed)
    out: list[list[int]] = []
    for k in range(0, len(prompts), batch):
        asks = [enc.prompt_ids(p) for p in prompts[k:k + batch]]
        width = max(map(len, asks))
        ids = torch.tensor([[pad] * (width - len(a)) + a for a in asks])           # (B, T) left-padded
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(a) for a in asks])[:, None]).long()
        kwargs = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                  if temperature > 0 else {"do_sample": False})
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             eos_token_id=eos, pad_token_id=pad, use_cache=True, **kwargs)[:, width:]
        for row in gen.tolist():
            out.append(row[: row.index(eos)] if eos in row else row)
    model.train()
    return out


def score(model, tok, recs: list[dict]) -> dict:
    """Greedy answers to ``recs``: mean reward, mean length (tokens), and a few examples."""
    from rankwise.data.instruct import def_line_reward
    ids = answer(model, tok, [r["prompt"] for r in recs])
    texts = [tok.decode(i) for i in ids]
    rewards = def_line_reward([r["prompt"] for r in recs], texts, id=[r["id"] for r in recs])
    return {"reward": statistics.fmean(rewards), "length": statistics.fmean(len(i) for i in ids),
            "examples": [{"id": r["id"], "answer": t} for r, t in list(zip(recs, texts))[:3]]}


def preference_pairs(model, tok, recs: list[dict], seed: int):
    """DPO pairs sampled from ``model``: chosen = a rewarded sample, rejected = an unrewarded one."""
    from rankwise.data.formats import IGNORE, Encoder, end_id
    from rankwise.data.instruct import def_line_reward
    from rankwise.tasks.pairs import PairData
    enc, eos = Encoder(tok, "prompt-completion", MAX_LEN), end_id(tok)
    prompts = [r["prompt"] for r in recs for _ in range(SAMPLES)]
    ids = answer(model, tok, prompts, temperature=TEMPERATURE, seed=seed)
    rewards = def_line_reward(prompts, [tok.decode(i) for i in ids],
                              id=[r["id"] for r in recs for _ in range(SAMPLES)])
    pairs, rewarded, all_good = [], sum(rewards), 0
    for n, rec in enumerate(recs):
        got = list(zip(ids[n * SAMPLES:(n + 1) * SAMPLES], rewards[n * SAMPLES:(n + 1) * SAMPLES]))
        good = [i for i, r in got if r == 1.0]
        bad = [i for i, r in got if r == 0.0]
        all_good += bool(good) and not bad
        if good and bad:
            ask = enc.prompt_ids(rec["prompt"])
            side = {}
            for name, tail in (("chosen", good[0] + [eos]), ("rejected", bad[0] + [eos])):
                keep = ask[-max(1, MAX_LEN - len(tail)):]
                side[name] = (keep + tail, [IGNORE] * len(keep) + tail)
            pairs.append({"chosen_ids": side["chosen"][0], "chosen_labels": side["chosen"][1],
                          "rejected_ids": side["rejected"][0], "rejected_labels": side["rejected"][1]})
    return PairData(pairs, tok.pad_token_id), {"samples": len(prompts), "rewarded_samples": int(rewarded),
                                               "pairs": len(pairs), "all_rewarded_prompts": int(all_good)}


def _log(seed: int, start: float, what: str) -> None:
    print(f"[preference] seed {seed}, {time.process_time() - start:.0f} s CPU: {what}", file=sys.stderr, flush=True)


def one_seed(seed: int, base, tok, train: list[dict], held: list[dict], base_scores: dict | None = None) -> dict:
    """The base (``base_scores`` when another seed has them: greedy, so the same), SFT, QFFT
    and DPO-after-SFT for one seed (progress lines on stderr)."""
    from rankwise.core.ops import merge_and_unload
    from rankwise.tasks import CausalLMTask
    from rankwise.tasks.dpo.task import DPOConfig, DPOTask
    start = time.process_time()
    res: dict = {"seed": seed, "base": base_scores or {"train": score(base, tok, train),
                                                        "held_out": score(base, tok, held)}}
    models = {}
    for name, qf in (("sft", False), ("qfft", True)):
        model = add_lora(copy.deepcopy(base), R, seed)
        losses = fit(model, CausalLMTask(), encode(tok, train, qf), SFT_STEPS, SFT_BATCH, SFT_LR, seed)
        res[name] = {"first_loss": losses[0], "final_loss": losses[-1], "train": score(model, tok, train),
                     "held_out": score(model, tok, held)}
        models[name] = model
        _log(seed, start, f"{name}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, reward train "
             f"{res[name]['train']['reward']:.3f}, held-out {res[name]['held_out']['reward']:.3f}")
    sft = merge_and_unload(models.pop("sft"))
    pairs, counts = preference_pairs(sft, tok, train, seed)
    res["dpo"] = {"pairs": counts}
    _log(seed, start, f"pairs {counts}")
    if len(pairs) >= DPO_BATCH // 2:
        model = add_lora(sft, DPO_R, seed)
        losses = fit(model, DPOTask(DPOConfig(beta=BETA, reference="adapters-off")), pairs,
                     DPO_STEPS, DPO_BATCH, DPO_LR, seed)
        res["dpo"].update(first_loss=losses[0], final_loss=losses[-1], train=score(model, tok, train),
                          held_out=score(model, tok, held))
    else:
        res["dpo"]["skipped"] = f"only {len(pairs)} pairs (need {DPO_BATCH // 2})"
    res["cpu_s"] = time.process_time() - start
    _log(seed, start, f"dpo: {res['dpo'].get('skipped') or res['dpo']['train']['reward']}")
    return res


def setup(train: list[dict], held: list[dict], base, tok, folder: Path | None) -> dict:
    """What the records were measured with."""
    return {"train_prompts": len(train), "held_out_prompts": len(held), "prompt_words": PROMPT_WORDS,
            "max_length": MAX_LEN, "new_tokens": NEW_TOKENS, "r": R, "alpha": ALPHA, "targets": TARGETS,
            "sft_steps": SFT_STEPS, "sft_batch": SFT_BATCH, "sft_lr": SFT_LR, "qfft_eos": QFFT_EOS,
            "samples": SAMPLES, "temperature": TEMPERATURE, "dpo_steps": DPO_STEPS, "dpo_batch": DPO_BATCH,
            "dpo_lr": DPO_LR, "dpo_r": DPO_R, "beta": BETA,
            "model": (f"the reference base ({sum(p.numel() for p in base.parameters()):,} parameters, "
                      f"its SentencePiece tokenizer of {len(tok):,})" if folder is None
                      else f"the base in {folder} ({len(tok)} tokens)")}


def run(out: Path, base: Path | None = None) -> dict:
    """Run every seed not yet recorded under ``out`` (``seed-N.json``, written as each ends),
    then write ``results.json``, ``results.md`` and ``preference.png`` over the recorded seeds.

    Args:
        out: The results folder.
        base: A base model folder instead of the reference base (the tests' tiny one).

    Returns:
        The record written to ``results.json``.
    """
    import transformers
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = load_base(base)
        train, held = records()
        for seed in SEEDS:
            if not (out / f"seed-{seed}.json").is_file():
                done = [out / f"seed-{s}.json" for s in SEEDS if (out / f"seed-{s}.json").is_file()]
                scores = json.loads(done[0].read_text())["base"] if done else None
                atomic.write_json(out / f"seed-{seed}.json", one_seed(seed, model, tok, train, held, scores))
    finally:
        torch.set_num_threads(threads)
    seeds = [json.loads((out / f"seed-{s}.json").read_text()) for s in SEEDS if (out / f"seed-{s}.json").is_file()]
    res = {"seeds": seeds, "summary": summarize(seeds), "setup": setup(train, held, model, tok, base),
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__},
           "command": COMMAND}
    write_results(out, res, markdown(res))
    plot(res, out / "preference.png")
    return res


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "seeds": values}


def summarize(seeds: list[dict]) -> dict:
    """Mean, sample std and per-seed values of reward and length per method and prompt set."""
    out: dict = {}
    for method in METHODS:
        for where in ("train", "held_out"):
            runs = [s[method][where] for s in seeds if where in s.get(method, {})]
            if runs:
                out[f"{method}/{where}"] = {k: _stats([r[k] for r in runs]) for k in ("reward", "length")}
    return out


def markdown(res: dict) -> str:
    """``results.md``: the setup, the table (mean ± std, per seed in brackets) and the pairs."""
    s, st = res["summary"], res["setup"]
    labels = {"base": "base (no fine-tuning)", "sft": "SFT (LoRA)", "qfft": "QFFT (same LoRA, responses alone)",
              "dpo": "DPO after SFT"}

    def cell(v: dict, fmt: str) -> str:
        return (f"{v['mean']:{fmt}} ± {v['std']:{fmt}} (" + ", ".join(f"{x:{fmt}}" for x in v["seeds"]) + ")")

    rows = [f"| {labels[m]} | {w.replace('_', '-')} | {cell(s[f'{m}/{w}']['reward'], '.3f')} | "
            f"{cell(s[f'{m}/{w}']['length'], '.1f')} |"
            for w in ("train", "held_out") for m in METHODS if f"{m}/{w}" in s]
    pairs = "; ".join(f"seed {x['seed']}: {x['dpo']['pairs']['pairs']} pairs from {x['dpo']['pairs']['samples']} "
                      f"samples ({x['dpo']['pairs']['rewarded_samples']} rewarded)" for x in res["seeds"])
    dpo_loss = ", ".join(f"{x['dpo']['first_loss']:.3f} → {x['dpo']['final_loss']:.3f}" for x in res["seeds"]
                         if "first_loss" in x["dpo"])
    return "\n".join([
        "# SFT vs QFFT vs DPO on stdlib-functions, on the reference base (quality only)", "",
        f"Command: `{res['command']}` (computes the seeds not yet recorded in `seed-N.json`).", "",
        f"Model: {st['model']}. Prompts: the first {st['prompt_words']} words of a stdlib docstring, "
        f"{st['train_prompts']} training and {st['held_out_prompts']} held-out; response: the `def` line. "
        f"SFT and QFFT: LoRA r={st['r']} alpha={st['alpha']:g} on {st['targets']}, {st['sft_steps']} steps of "
        f"{st['sft_batch']}, AdamW lr {st['sft_lr']}; QFFT on the responses alone (EOS after each: "
        f"{str(st['qfft_eos']).lower()}). DPO: SFT merged, fresh LoRA r={st['dpo_r']}, {st['dpo_steps']} steps "
        f"of {st['dpo_batch']} pairs, lr {st['dpo_lr']}, beta {st['beta']}, reference adapters-off (the SFT "
        f"model); pairs from {st['samples']} samples per training prompt at temperature {st['temperature']} "
        "(chosen rewarded, rejected unrewarded, same prompt). Greedy answers, at most "
        f"{st['new_tokens']} new tokens. Reward = the answer's first line parses as a `def` line naming the "
        "right function (`rankwise.data.instruct:def_line_reward`). Mean ± sample std over the seeds "
        + ", ".join(str(x["seed"]) for x in res["seeds"]) + " (per seed in brackets).", "",
        "| method | prompts | reward (accuracy) | response length, tokens |", "|---|---|---:|---:|", *rows, "",
        f"DPO pairs: {pairs}.", "", f"DPO loss, first → last step: {dpo_loss or '—'}.", "",
        "CPU time per seed (one thread): " + ", ".join(f"{x['cpu_s']:.0f} s" for x in res["seeds"]) + ".", ""])


def plot(res: dict, path: Path) -> None:
    """Reward and length per method on both prompt sets (bars: means; dots: seeds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = res["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3), dpi=100)
    for ax, key, label in ((axes[0], "reward", "reward (accuracy)"), (axes[1], "length", "response tokens")):
        names = [m for m in METHODS if f"{m}/train" in s]
        for off, where, colour in ((-0.2, "train", "#9ab"), (0.2, "held_out", "#db9")):
            vals = [s[f"{m}/{where}"][key]["seeds"] if f"{m}/{where}" in s else [] for m in names]
            ax.bar([i + off for i in range(len(names))], [statistics.fmean(v) if v else 0 for v in vals],
                   width=0.4, color=colour, label=where.replace("_", "-"))
            for i, v in enumerate(vals):
                ax.plot([i + off] * len(v), v, "k.", ms=4)
        ax.set_xticks(range(len(names)), [n.upper() for n in names])
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


__all__ = ["run", "records", "encode", "preference_pairs", "markdown"]
