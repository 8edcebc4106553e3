"""Benchmark: the ``dpo`` task on a rankwise LoRA against TRL's DPO loss on a PEFT LoRA
(``rankwise bench dpo``).

Setup (both sides identical): a 4-layer, 128-wide Llama built in code (the packaged MiniLM
tokenizer, so a 30k vocabulary), LoRA r=8, alpha=16 on ``q_proj``/``k_proj``/``v_proj``/``o_proj``
with PEFT's adapter copied from rankwise's initial A and B, preference pairs built from real text
(a stdlib docstring -> its function's ``def`` line, chosen, or the next function's, rejected; up
to 96 tokens), batches of 8 pairs, ``torch.optim.AdamW``, sigmoid loss, beta 0.1, the reference
from the disabled adapters on both sides.

One step is forward (policy and reference) + backward + AdamW step. rankwise's step is
:meth:`rankwise.engine.Engine.train_step`; TRL's is ``DPOTrainer._compute_loss`` (its own
forward, reference and loss) + ``backward`` + the same AdamW step, on the same token batch: the
trainer's data collation, accelerate and logging loop are left out, so the comparison is the
model-and-loss path. The two alternate step by step (order flipped every repetition) after
warm-up; time is process CPU time with one torch thread (the machine is shared), memory the
peak bytes of live tensors one step adds (:mod:`rankwise.memory`). Losses of the first step must
agree.
"""
from __future__ import annotations

import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from rankwise.testing import same_factors
from rankwise_bench.common import llama, write_results

R, ALPHA, TARGETS = 8, 16.0, ["q_proj", "k_proj", "v_proj", "o_proj"]
PAIRS, MAX_LEN, BATCH, BETA, LR = 64, 96, 8, 0.1, 1e-4
WARMUP, REPS = 2, 6


def _model(vocab: int):
    return llama(vocab, 128, 4, 4, 256, kv_heads=2, positions=128, seed=0,
                 pad_token_id=0, bos_token_id=0, eos_token_id=0)


BASES = ("float32", "bfloat16", "nf4")


def _base(vocab: int, kind: str):
    """The benchmark's base in ``kind``: fp32, bf16, or NF4 (bitsandbytes 4-bit, bf16 compute and
    storage, double quantization: ``model.quantize: nf4`` of a run, quantized as rankwise loads a
    model built in code). Built afresh per call: the same seed gives the same weights and codes."""
    model = _model(vocab)
    if kind == "bfloat16":
        return model.to(torch.bfloat16)
    if kind == "nf4":
        from transformers import AutoModelForCausalLM

        from rankwise.recipes.model import _quantize_in_memory, bnb_config
        return _quantize_in_memory(model, AutoModelForCausalLM, bnb_config("nf4", "bfloat16"),
                                   torch.bfloat16, "cpu")
    return model


def fp32_adapters(model) -> None:
    """Keep a PEFT model's trainable factors in float32. TRL casts them to bf16 on a quantized
    base (its QLoRA rule); rankwise keeps float32 factors: the rows compare the same model."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


def check_fp32_adapters(ours, theirs) -> None:
    for name, model in (("rankwise", ours), ("trl", theirs)):
        bad = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32]
        assert not bad, (name, bad[:2])


def _pairs(tok):
    """Preference pairs (rankwise.tasks.pairs' encoding) from the stdlib-functions records."""
    from rankwise.data.formats import Encoder
    from rankwise.data.instruct import load_function_records
    from rankwise.tasks.pairs import PairData, PairEncoder
    recs = load_function_records()[: PAIRS * 2 + 1]
    pe = PairEncoder(Encoder(tok, "prompt-completion", MAX_LEN))
    pairs = []
    for a, b in zip(recs, recs[1:]):
        prompt, chosen = pe.completion(pe.prompt(a["prompt"], 0), a["completion"], 0)
        _, rejected = pe.completion(pe.prompt(a["prompt"], 0), b["completion"], 0)
        fitted = pe.fit(prompt, [chosen, rejected])
        if fitted and a["completion"] != b["completion"]:
            (ci, cl), (ri, rl) = fitted
            pairs.append({"chosen_ids": ci, "chosen_labels": cl, "rejected_ids": ri, "rejected_labels": rl})
        if len(pairs) == PAIRS:
            break
    return PairData(pairs, tok.pad_token_id)


def _build(tok, tmp: Path, kind: str = "float32"):
    import peft
    import trl
    from datasets import Dataset

    from rankwise.adapters.lora import LoraConfig, apply_lora
    ours = _base(len(tok), kind)
    apply_lora(ours, LoraConfig(r=R, alpha=ALPHA, targets=TARGETS, dropout=0.0))
    args = trl.DPOConfig(output_dir=str(tmp), beta=BETA, loss_type=["sigmoid"], report_to=[],
                         use_cpu=True, bf16=False, fp16=False)
    data = Dataset.from_dict({"prompt": ["a"], "chosen": [" b"], "rejected": [" c"]})
    tok = copy.deepcopy(tok)
    tok.eos_token = tok.eos_token or tok.sep_token  # TRL appends EOS; MiniLM's tokenizer ends with [SEP]
    trainer = trl.DPOTrainer(model=_base(len(tok), kind), args=args, train_dataset=data,
                             processing_class=tok, peft_config=peft.LoraConfig(
                                 r=R, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    fp32_adapters(trainer.model)
    same_factors(ours, trainer.model)
    return ours.train(), trainer


def _steps(ours, trainer, data):
    from rankwise.engine import Engine
    from rankwise.tasks.dpo.task import DPOConfig, DPOTask
    task = DPOTask(DPOConfig(beta=BETA, reference="adapters-off"))
    opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=LR)
    engine = Engine(ours, task, opt, data, BATCH, seed=0)
    theirs = trainer.model.train()
    topt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=LR)
    from rankwise.engine.loop import draw_batches

    def mine(k: int) -> float:
        return engine.train_step(k).loss

    def trl_step(k: int) -> float:
        batch = draw_batches(data, task, k, BATCH, 0, "cpu")[0]
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                  "completion_mask": (batch["labels"] != -100).long()}
        loss = trainer._compute_loss(theirs, inputs, False)
        loss.backward()
        topt.step()
        topt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return mine, trl_step


def _timed(fn, k: int) -> tuple[float, float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    loss = fn(k)
    return time.process_time() - c0, time.perf_counter() - w0, loss


def interleaved(mine, theirs, warmup: int = WARMUP, reps: int = REPS) -> dict:
    """Step both sides (``fn(step) -> loss``) ``warmup`` times, then ``reps`` timed steps in
    alternating order, then one step each under the memory meter: the row's medians and ratios
    (``bench dpo`` and ``bench grpo`` measure the same way)."""
    from rankwise.memory import PeakMemory
    first = (mine(0), theirs(0))
    for k in range(1, warmup):
        mine(k), theirs(k)
    cpu = {"rankwise": [], "trl": []}
    wall = {"rankwise": [], "trl": []}
    diffs = []
    for rep in range(reps):
        k = warmup + rep
        order = [("rankwise", mine), ("trl", theirs)][:: 1 if rep % 2 == 0 else -1]
        losses = {}
        for name, fn in order:
            c, w, losses[name] = _timed(fn, k)
            cpu[name].append(c)
            wall[name].append(w)
        diffs.append(abs(losses["rankwise"] - losses["trl"]))
    peak = {}
    for name, fn in (("rankwise", mine), ("trl", theirs)):
        with PeakMemory("cpu") as mem:
            fn(warmup + reps)
        peak[name] = mem.peak_bytes / 2**20
    med = {k: statistics.median(v) for k, v in cpu.items()}
    return {"step_cpu_s": med, "step_wall_s": {k: statistics.median(v) for k, v in wall.items()},
            "step_time_ratio": med["rankwise"] / med["trl"],
            "peak_step_mb": peak, "memory_ratio": peak["rankwise"] / peak["trl"],
            "first_loss": {"rankwise": first[0], "trl": first[1]},
            "max_loss_diff_timed_steps": max(diffs),
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _measure(tok, data, kind: str) -> dict:
    """One row: both sides on a base of ``kind`` (adapters fp32 on both), interleaved."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ours, trainer = _build(tok, Path(tmp), kind)
        check_fp32_adapters(ours, trainer.model)
        return interleaved(*_steps(ours, trainer, data))


def measured_rows(out: Path, setup: dict) -> dict:
    """The rows an earlier run of the same setup left in ``out/results.json`` (a run measures only
    the missing rows and writes after each, so a long benchmark can be finished in several runs)."""
    try:
        old = json.loads((Path(out) / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    same = {k: v for k, v in old.get("setup", {}).items() if k not in ("base_dtypes", "nf4")} == \
        {k: v for k, v in setup.items() if k not in ("base_dtypes", "nf4")}
    return dict(old.get("rows", {})) if same else {}


def run(out: Path) -> dict:
    """Run the benchmark (fp32, bf16 and NF4 bases; rows already in ``out`` of the same setup are
    kept) and write ``out/results.json`` and ``out/results.md`` after each row."""
    from rankwise.errors import require
    from rankwise.recipes.model import load_tokenizer
    for module in ("peft", "trl", "bitsandbytes"):
        require(module, "bench", "rankwise bench dpo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    setup = {"pairs": PAIRS, "batch_pairs": BATCH, "max_length": MAX_LEN, "r": R, "alpha": ALPHA,
             "targets": TARGETS, "beta": BETA, "base_dtypes": list(BASES)}
    rows = measured_rows(out, setup)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        tok = load_tokenizer("tiny-llama")
        data = _pairs(tok)
        record_rows(out, rows, setup, start, lambda kind: _measure(tok, data, kind), markdown)
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "results.json").read_text())


def record_rows(out: Path, rows: dict, setup: dict, start: float, measure, markdown) -> None:
    """Measure each base of :data:`BASES` not yet in ``rows`` (``measure(kind) -> row``) and
    rewrite ``results.json`` / ``results.md`` after each, so an interrupted run resumes (``bench
    dpo`` and ``bench grpo`` record the same way)."""
    import peft
    import transformers
    import trl
    for kind in BASES:
        if kind in rows:
            continue
        rows[kind] = measure(kind)
        res = {**rows.get("float32", rows[kind]), "rows": dict(rows), "reps": REPS, "warmup": WARMUP,
               "setup": setup, "targets": {"step_time_ratio": 1.0, "memory_ratio": 1.0},
               "versions": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "peft": peft.__version__,
                            "trl": trl.__version__, "bitsandbytes": __import__("bitsandbytes").__version__,
                            "cpu_count": __import__("os").cpu_count()},
               "wall_s": time.perf_counter() - start}
        write_results(out, res, markdown(res))


def ordered(rows: dict) -> list:
    """The rows in :data:`BASES` order (a JSON round trip sorts them)."""
    return sorted(rows.items(), key=lambda kv: BASES.index(kv[0]) if kv[0] in BASES else len(BASES))


def vs_trl_table(rows: dict, unstamped: str = "?") -> list[str]:
    """The ratio table of a bench against TRL + PEFT (``bench dpo``, ``bench grpo``) and the
    line of first-step losses under it; ``unstamped`` stands for a row recorded without a date."""
    table = ["| base | measure (CPU time, 1 thread) | rankwise | TRL + PEFT | ratio | target |",
             "|---|---|---:|---:|---:|---:|"]
    for kind, row in ordered(rows):
        s, m = row["step_cpu_s"], row["peak_step_mb"]
        table += [f"| {kind} | train step, median s | {s['rankwise']:.4f} | {s['trl']:.4f} | "
                  f"{row['step_time_ratio']:.3f} | <= 1.0 |",
                  f"| {kind} | peak step memory, MiB | {m['rankwise']:.1f} | {m['trl']:.1f} | "
                  f"{row['memory_ratio']:.3f} | <= 1.0 |"]
    losses = [f"{k}: first-step loss rankwise {r['first_loss']['rankwise']:.6f}, TRL "
              f"{r['first_loss']['trl']:.6f}, max |difference| over the timed steps "
              f"{r['max_loss_diff_timed_steps']:.2e} (measured {r.get('measured_at', unstamped)})"
              for k, r in ordered(rows)]
    return [*table, "", "; ".join(losses) + "."]


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    v = res["versions"]
    return "\n".join([
        "# DPO: rankwise LoRA + dpo task vs TRL DPO loss + PEFT LoRA", "",
        "Command: `OMP_NUM_THREADS=1 flock /tmp/bench.lock rankwise bench dpo --out bench/results/dpo`", "",
        f"4-layer 128-wide Llama (30k vocabulary), LoRA r={R} alpha={ALPHA:g} on {'/'.join(TARGETS)}, "
        f"{res['setup']['pairs']} docstring -> def-line pairs up to {MAX_LEN} tokens, {BATCH} pairs per "
        f"step, sigmoid loss beta={BETA}, reference = adapters off on both sides, AdamW; the base in "
        "fp32, bf16 or NF4 (bitsandbytes 4-bit, bf16 compute and storage, double quantization; the "
        "same codes on both sides), adapters fp32 on both sides (checked; TRL's own cast of "
        "adapters to bf16 on a quantized base is undone), no autocast. "
        f"{REPS} interleaved repetitions after {WARMUP} warm-up steps; medians; one process.", "",
        *vs_trl_table(res["rows"]), "",
        "TRL's step here is `DPOTrainer._compute_loss` + backward + AdamW (its collator, accelerate "
        "and logging loop are not timed). Where the difference comes from (read from TRL 1.16's "
        "code, not profiled): TRL's fused LM head also computes, at every position and over the "
        "whole vocabulary, the entropy, mean logit and top-1 flag it logs, in the policy and the "
        "reference forward; rankwise normalises the vocabulary only at completion positions. The "
        "machine is shared with other jobs: the ratio of the two, measured in the same process and "
        "interleaved, is the figure to read. NF4 runs bitsandbytes' CPU path (this machine has "
        "avx512_bf16).", "",
        f"Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}, "
        f"trl {v['trl']}, bitsandbytes {v['bitsandbytes']}, {v['cpu_count']} CPUs. "
        f"Last run {res['wall_s']:.0f} s.", ""])


__all__ = ["run"]
