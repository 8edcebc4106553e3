"""Benchmark: SVDecode against plain decoding of the warm-start PEFT model
(``rankwise bench svdecode``; issue 24's measured table, rerun on the reference base for issue 36).

Task: ``stdlib-functions`` (prompt: the first ``PROMPT_WORDS`` words of a standard-library
function's docstring; completion: its ``def`` line); accuracy = the completion's ``def`` line
names the record's function (:func:`def_line_correct`, case-insensitive).

Decision (issue 35 item 2): SVDecode's claim is about a *pretrained* model P_pre and a PEFT warm
start of it, so the base is the reference base (:func:`rankwise_bench.common.reference_base`,
6.45M parameters pretrained on the standard library, its SentencePiece tokenizer), loaded as it
is; the former base -- ``bench dpo``'s random 4-layer Llama with the MiniLM tokenizer,
"pre-trained" here on 384 records -- and its pretraining code are gone. Warm starts, short
fine-tunes of the base through :class:`rankwise.engine.Engine` on ``TRAIN`` records: LoRA (r 8,
all linear layers) and prompt tuning (20 virtual tokens). Each warm start answers the first
``EVAL_TRAIN`` of its training prompts and ``HELD_OUT`` unseen prompts greedily (at most
``NEW_TOKENS`` tokens) with plain decoding (adapter on) and with SVDecode at several strengths λ
(λ = 1 is the calibrated step μ*, the Gauss-Newton minimiser of the warm-start training labels'
cross-entropy under the steered logits; P_pre = the same model with its adapter off). μ*, the
applied μ, whether it was clipped and the per-token clip shares are recorded per warm start.

Cost per token: process CPU time per generated token of plain decoding and of SVDecode in the
same process (one torch thread, alternating, several repetitions), reported as a ratio.

Pieces (each resumable; scratch weights in ``_work/``): ``SVDECODE_PIECE=quality`` (warm starts,
accuracies: quality only) and ``SVDECODE_PIECE=timing`` (the cost ratio); unset: both.
"""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch

from rankwise.core import atomic
from rankwise_bench.common import reference_base, write_results

TRAIN, EVAL_TRAIN, HELD_OUT, PROMPT_WORDS = 256, 64, 128, 32
MAX_LEN, NEW_TOKENS = 96, 24
WARM = {"lora": ({"r": 8, "alpha": 16.0, "targets": "all-linear", "dropout": 0.0}, 80, 3e-3),
        "prompt-tuning": ({"num_virtual_tokens": 20, "modules_to_save": []}, 80, 3e-2)}
STRENGTHS = (0.5, 1.0, 2.0)
TIME_PROMPTS, TIME_REPS = 8, 3
COMMANDS = {"quality": "OMP_NUM_THREADS=1 SVDECODE_PIECE=quality flock /tmp/core2.lock "
                       "rankwise bench svdecode --out bench/results/svdecode",
            "timing": "OMP_NUM_THREADS=1 SVDECODE_PIECE=timing flock /tmp/core2.lock "
                      "rankwise bench svdecode --out bench/results/svdecode"}


def records() -> tuple[list[dict], list[dict]]:
    """``(warm-start training, held-out)`` records, disjoint and spread over the packages (every
    k-th function; they alternate between the two)."""
    from rankwise.data.instruct import load_function_records
    recs = [{"prompt": " ".join(r["prompt"].split()[:PROMPT_WORDS]) + "\n", "completion": r["completion"],
             "id": r["id"]} for r in load_function_records()]
    step = max(1, len(recs) // (TRAIN + HELD_OUT))
    pick = recs[::step][: TRAIN + HELD_OUT]
    return ([r for k, r in enumerate(pick) if k % 3 != 1][:TRAIN],    # 2 of every 3 picked
            [r for k, r in enumerate(pick) if k % 3 == 1][:HELD_OUT])


def def_line_correct(text: str, completion: str) -> bool:
    """Whether ``text`` is a ``def`` line naming the function of the reference ``completion``
    (case-insensitive; the spacing the uncased word-piece decoding puts around ``_`` undone)."""
    want = re.match(r"\s*(?:async\s+)?def\s+(\w+)", completion)
    got = re.match(r"\s*(?:async\s+)?def\s+([\w ]+?)\s*\(", text)
    return bool(want and got and got.group(1).replace(" ", "").lower() == want.group(1).lower())


class Examples(list):
    """Token examples with the ``pad_id`` the engine reads."""

    def __init__(self, items: list[dict], pad_id: int) -> None:
        super().__init__(items)
        self.pad_id = pad_id


def encode(tok, recs: list[dict]) -> Examples:
    from rankwise.data.formats import Encoder
    enc = Encoder(tok, "prompt-completion", MAX_LEN)
    out = enc({"prompt": [r["prompt"] for r in recs], "completion": [r["completion"] for r in recs]},
              list(range(len(recs))))
    return Examples([{"input_ids": i, "labels": lab} for i, lab in zip(out["input_ids"], out["labels"]) if i],
                    tok.pad_token_id)


def fit(model, data, steps: int, batch: int, lr: float, seed: int = 0) -> list[float]:
    from rankwise.engine import Engine, get_task
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    engine = Engine(model, get_task("causal-lm"), opt, data, batch, seed=seed, grad_clip=1.0)
    return [engine.train_step(k).loss for k in range(steps)]


def base():
    """The reference base in float32, ``(model, tokenizer)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = reference_base()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def warm_start(tok, work: Path, method: str):
    """The base + a short ``method`` fine-tune (adapter weights cached in ``work/METHOD.pt``)."""
    import rankwise
    model, _ = base()
    torch.manual_seed(1)
    kwargs, steps, lr = WARM[method]
    rankwise.apply(model, method, **kwargs)
    path = work / f"{method}.pt"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if path.is_file():
        model.load_state_dict(torch.load(path), strict=False)
        return model.eval(), json.loads((work / f"{method}.json").read_text())
    train, _ = records()
    losses = fit(model.train(), encode(tok, train), steps, 16, lr)
    torch.save({n: p for n, p in model.state_dict().items() if n in trainable}, path)
    info = {"steps": steps, "lr": lr, "loss_first": losses[0], "loss_last": statistics.fmean(losses[-5:])}
    atomic.write_bytes(work / f"{method}.json", json.dumps(info).encode())
    return model.eval(), info


def answers(model, tok, recs: list[dict], strength: float, mu_star: float) -> list[str]:
    from rankwise.data.formats import Encoder, end_id
    from rankwise.engine.svdecode import SVDecode, SVDecodeConfig, steered_generate
    enc, eos = Encoder(tok, "prompt-completion", MAX_LEN), end_id(tok)
    sv = SVDecode(SVDecodeConfig(strength=strength, mu=mu_star))
    return [tok.decode(steered_generate(model, enc.prompt_ids(r["prompt"]), NEW_TOKENS, eos, sv),
                       skip_special_tokens=True) for r in recs]


def quality(tok, work: Path, method: str) -> dict:
    import dataclasses

    from rankwise.engine.svdecode import SVDecode
    model, info = warm_start(tok, work, method)
    train, held = records()
    fit = SVDecode().calibrate(model, encode(tok, train))  # μ on the warm start's own training data
    train = train[:EVAL_TRAIN]
    out = {"warm_start": info, "strengths": [0.0, *STRENGTHS], "mu_fit": dataclasses.asdict(fit)}
    for split, recs in (("train", train), ("held_out", held)):
        acc, examples = {}, {}
        for lam in (0.0, *STRENGTHS):
            texts = answers(model, tok, recs, lam, fit.mu_star)
            acc[str(lam)] = statistics.fmean(def_line_correct(t, r["completion"]) for t, r in zip(texts, recs))
            examples[str(lam)] = [{"id": r["id"], "answer": t} for r, t in list(zip(recs, texts))[:2]]
        out[split] = {"accuracy": acc, "n": len(recs), "examples": examples}
    with torch.no_grad():  # how far the warm start moved the distribution: mean TV(p_w, p_0) on the prompts
        from rankwise.core.ops import disable_adapters
        from rankwise.data.formats import Encoder
        enc, tv = Encoder(tok, "prompt-completion", MAX_LEN), []
        for r in held:
            ids = torch.tensor([enc.prompt_ids(r["prompt"])])
            p_w = torch.softmax(model(input_ids=ids).logits[0, -1], -1)
            with disable_adapters(model):
                p_0 = torch.softmax(model(input_ids=ids).logits[0, -1], -1)
            tv.append(0.5 * float((p_w - p_0).abs().sum()))
        out["mean_tv_warm_vs_pre_first_token"] = statistics.fmean(tv)
    return out


def timing(tok, work: Path) -> dict:
    from rankwise.data.formats import Encoder, end_id
    from rankwise.engine.svdecode import SVDecode, SVDecodeConfig, steered_generate
    model, _ = warm_start(tok, work, "lora")
    _, held = records()
    enc, eos = Encoder(tok, "prompt-completion", MAX_LEN), end_id(tok)
    prompts = [enc.prompt_ids(r["prompt"]) for r in held[:TIME_PROMPTS]]
    rules = {"plain": SVDecode(SVDecodeConfig(strength=0.0)),
             "svdecode": SVDecode(SVDecodeConfig(mu=1.0))}  # the cost does not depend on μ's value
    cpu: dict[str, list[float]] = {k: [] for k in rules}

    def once(rule) -> float:
        start, tokens = time.process_time(), 0
        for p in prompts:  # fixed length: EOS ignored (eos=-1), so both decode the same count
            tokens += len(steered_generate(model, p, NEW_TOKENS, -1, rule))
        return (time.process_time() - start) / tokens

    once(rules["plain"]), once(rules["svdecode"])  # warm-up
    for rep in range(TIME_REPS):
        for name in (list(rules) if rep % 2 == 0 else list(rules)[::-1]):
            cpu[name].append(once(rules[name]))
    med = {k: statistics.median(v) for k, v in cpu.items()}
    return {"cpu_s_per_token": med, "ratio_svdecode_over_plain": med["svdecode"] / med["plain"],
            "reps": TIME_REPS, "prompts": TIME_PROMPTS, "tokens_per_prompt": NEW_TOKENS,
            "note": "process CPU time, one torch thread, same process, alternating order; the "
                    "machine was shared, so only the ratio is meaningful"}


def run(out: Path) -> dict:
    """Run the missing pieces and write ``out/results.json`` and ``out/results.md``."""
    out = Path(out)
    work = out / "_work"
    work.mkdir(parents=True, exist_ok=True)
    piece = os.environ.get("SVDECODE_PIECE", "")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = base()[1]
        path = out / "results.json"
        res = json.loads(path.read_text()) if path.is_file() else {}
        res.setdefault("quality", {})
        warm = {k: {"config": v[0], "steps": v[1], "lr": v[2]} for k, v in WARM.items()}
        res.update(setup={"base": "bench/reference-base/model", "train": TRAIN, "eval_train": EVAL_TRAIN,
                          "held_out": HELD_OUT, "prompt_words": PROMPT_WORDS, "warm": warm,
                          "new_tokens": NEW_TOKENS, "torch": torch.__version__,
                          "machine": platform.machine()}, commands=COMMANDS)
        if piece in ("", "quality"):
            for method in WARM:
                if method not in res["quality"]:
                    start = time.process_time()
                    res["quality"][method] = quality(tok, work, method)
                    res["quality"][method]["cpu_s"] = time.process_time() - start
                    _write(out, res)
        if piece in ("", "timing") and "timing" not in res:
            res["timing"] = timing(tok, work)
        _write(out, res)
        return res
    finally:
        torch.set_num_threads(threads)


def _write(out: Path, res: dict) -> None:
    write_results(out, res, markdown(res))


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    lines = ["# SVDecode vs plain decoding of the warm-start PEFT model", "",
             "stdlib-functions def-line accuracy, greedy; λ = 0 is plain decoding (adapter on). P_pre: the "
             "reference base (`bench/reference-base/model`) as it is; each warm start fine-tunes it on "
             f"{res['setup']['train']} records.", ""]
    for method, q in res.get("quality", {}).items():
        lams = q["strengths"]
        lines += [f"## {method} warm start ({q['warm_start']['steps']} steps, loss "
                  f"{q['warm_start']['loss_first']:.2f} → {q['warm_start']['loss_last']:.2f}; "
                  f"mean TV(p_warm, p_pre) at the first token {q['mean_tv_warm_vs_pre_first_token']:.3f})", "",
                  "| split | n | " + " | ".join(f"λ={lam}" for lam in lams) + " |",
                  "|---|---|" + "---|" * len(lams)]
        for split in ("train", "held_out"):
            acc = q[split]["accuracy"]
            lines.append(f"| {split} | {q[split]['n']} | " + " | ".join(f"{acc[str(lam)]:.3f}" for lam in lams) + " |")
        if "mu_fit" in q:
            f = q["mu_fit"]
            lines += ["", f"μ* = {f['mu_star']:.4g} on {f['tokens']} warm-start training tokens "
                      f"(applied at λ=1: {f['mu']:.4g}{', clipped: ' + f['clipped'] if f['clipped'] else ''}); "
                      f"label CE {f['loss_plain']:.4f} → {f['loss_steered']:.4f}. Per-token ratio "
                      f"above max_mu on {100 * f['token_clip_fraction']:.1f} % of tokens; the former "
                      f"per-step rule would have clipped on {100 * f['step_rule_clip_fraction']:.1f} %."]
        lines.append("")
    if "timing" in res:
        t = res["timing"]
        lines += ["## Cost per token (LoRA warm start)", "",
                  f"plain {t['cpu_s_per_token']['plain'] * 1e3:.2f} ms, SVDecode "
                  f"{t['cpu_s_per_token']['svdecode'] * 1e3:.2f} ms CPU per token: ratio "
                  f"**{t['ratio_svdecode_over_plain']:.2f}×** ({t['note']}).", ""]
    lines += ["Commands:", "", *[f"    {c}" for c in res.get("commands", COMMANDS).values()], ""]
    return "\n".join(lines)
