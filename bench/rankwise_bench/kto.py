"""Benchmark: the ``kto`` task on a rankwise LoRA against TRL's ``KTOTrainer`` loss on a PEFT LoRA
(``rankwise bench kto``).

Setup (both sides identical): the 4-layer, 128-wide Llama of ``bench dpo`` (the packaged MiniLM
tokenizer, so a 30k vocabulary), LoRA r=8, alpha=16 on ``q_proj``/``k_proj``/``v_proj``/``o_proj``
with PEFT's adapter copied from rankwise's initial A and B, unpaired examples built from real text
(a stdlib docstring -> its own function's ``def`` line, desirable, or the next function's,
undesirable, alternating; up to 96 tokens), batches of 8 examples with TRL's mismatched KL rows
(the completions rotated by one), ``torch.optim.AdamW``, beta 0.1, weights 1, the reference from
the disabled adapters on both sides.

One step is the mismatched KL forward (no gradient), the policy forward, the reference forwards
of both, the loss, backward and an AdamW step. rankwise's step is
:meth:`rankwise.engine.Engine.train_step`; TRL's is ``KTOTrainer._compute_loss`` (its own forwards,
reference and loss) + ``backward`` + the same AdamW step, on the same token batch (rankwise's
collated rows, KL rows included): the trainer's dataset preparation, accelerate and logging loop
are left out. Measured as ``bench dpo`` measures (:func:`rankwise_bench.dpo.interleaved`): the
two sides alternate step by step after warm-up; process CPU time with one torch thread; memory
the peak bytes of live tensors one step adds. Losses of the first step must agree.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from rankwise.testing import same_factors
from rankwise_bench.dpo import (BASES, REPS, WARMUP, _base, check_fp32_adapters, fp32_adapters, interleaved,
                                measured_rows, record_rows, vs_trl_table)

R, ALPHA, TARGETS = 8, 16.0, ["q_proj", "k_proj", "v_proj", "o_proj"]
EXAMPLES, MAX_LEN, BATCH, BETA, LR = 64, 96, 8, 0.1, 1e-4


def examples(tok, n: int = EXAMPLES):
    """Unpaired examples (rankwise.tasks.pairs' encoding, as kto's data) from the stdlib-functions records:
    even records desirable (their own ``def`` line), odd ones undesirable (the next function's)."""
    from rankwise.data.formats import Encoder
    from rankwise.data.instruct import load_function_records
    from rankwise.tasks.kto.data import UnpairedData
    from rankwise.tasks.pairs import PairEncoder, cut_prompt
    recs = load_function_records()
    ue = PairEncoder(Encoder(tok, "prompt-completion", MAX_LEN))
    out = []
    for i, (a, b) in enumerate(zip(recs, recs[1:])):
        good = len(out) % 2 == 0
        prompt, completion = ue.encode(a["prompt"], a["completion"] if good else b["completion"], i + 1)
        cut = cut_prompt(prompt, len(completion), ue.keep, MAX_LEN)
        if cut is not None and a["completion"] != b["completion"]:
            out.append({"prompt_ids": cut, "completion_ids": completion, "label": good})
        if len(out) == n:
            break
    return UnpairedData(out, tok.pad_token_id, ue.keep, MAX_LEN)


def _build(tok, tmp: Path, kind: str = "float32"):
    import peft
    import trl
    from datasets import Dataset

    from rankwise.adapters.lora import LoraConfig, apply_lora
    ours = _base(len(tok), kind)
    apply_lora(ours, LoraConfig(r=R, alpha=ALPHA, targets=TARGETS, dropout=0.0))
    args = trl.KTOConfig(output_dir=str(tmp), beta=BETA, report_to=[], use_cpu=True, bf16=False, fp16=False,
                         per_device_train_batch_size=BATCH, gradient_checkpointing=False)
    data = Dataset.from_dict({"prompt": ["a", "b"], "completion": [" b", " c"], "label": [True, False]})
    tok = copy.deepcopy(tok)
    tok.eos_token = tok.eos_token or tok.sep_token  # TRL appends EOS; MiniLM's tokenizer ends with [SEP]
    trainer = trl.KTOTrainer(model=_base(len(tok), kind), args=args, train_dataset=data, processing_class=tok,
                             peft_config=peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS,
                                                         lora_dropout=0.0))
    fp32_adapters(trainer.model)
    same_factors(ours, trainer.model)
    return ours.train(), trainer


def trl_inputs(batch: dict) -> dict:
    """TRL's ``KTOTrainer`` inputs for a rankwise ``kto`` batch (the same rows, KL rows included)."""
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "completion_mask": (batch["labels"] != -100).long(), "KL_input_ids": batch["kl_input_ids"],
            "KL_attention_mask": batch["kl_attention_mask"],
            "KL_completion_mask": (batch["kl_labels"] != -100).long(), "label": batch["desirable"]}


def _steps(ours, trainer, data):
    from rankwise.engine import Engine
    from rankwise.engine.loop import draw_batches
    from rankwise.tasks.kto.task import KTOConfig, KTOTask
    task = KTOTask(KTOConfig(beta=BETA, reference="adapters-off"))
    opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=LR)
    engine = Engine(ours, task, opt, data, BATCH, seed=0)
    theirs = trainer.model.train()
    topt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=LR)

    def mine(k: int) -> float:
        return engine.train_step(k).loss

    def trl_step(k: int) -> float:
        loss = trainer._compute_loss(theirs, trl_inputs(draw_batches(data, task, k, BATCH, 0, "cpu")[0]), False)
        loss.backward()
        topt.step()
        topt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return mine, trl_step


def _measure(tok, data, kind: str) -> dict:
    """One row: both sides on a base of ``kind`` (adapters fp32 on both), interleaved."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ours, trainer = _build(tok, Path(tmp), kind)
        check_fp32_adapters(ours, trainer.model)
        return interleaved(*_steps(ours, trainer, data))


def run(out: Path) -> dict:
    """Run the benchmark (fp32, bf16 and NF4 bases; rows already in ``out`` of the same setup are
    kept) and write ``out/results.json`` and ``out/results.md`` after each row."""
    from rankwise.errors import require
    from rankwise.recipes.model import load_tokenizer
    for module in ("peft", "trl", "bitsandbytes"):
        require(module, "bench", "rankwise bench kto")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    setup = {"examples": EXAMPLES, "batch_examples": BATCH, "max_length": MAX_LEN, "r": R, "alpha": ALPHA,
             "targets": TARGETS, "beta": BETA, "base_dtypes": list(BASES)}
    rows = measured_rows(out, setup)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        tok = load_tokenizer("tiny-llama")
        data = examples(tok)
        record_rows(out, rows, setup, start, lambda kind: _measure(tok, data, kind), markdown)
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "results.json").read_text())


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    v = res["versions"]
    return "\n".join([
        "# KTO: rankwise LoRA + kto task vs TRL KTO loss + PEFT LoRA", "",
        "Command: `OMP_NUM_THREADS=1 flock /tmp/bench.lock rankwise bench kto --out bench/results/kto`", "",
        f"4-layer 128-wide Llama (30k vocabulary), LoRA r={R} alpha={ALPHA:g} on {'/'.join(TARGETS)}, "
        f"{res['setup']['examples']} docstring -> def-line examples (half desirable, half undesirable) "
        f"up to {MAX_LEN} tokens, {BATCH} examples per step with TRL's mismatched KL rows, beta={BETA}, "
        "weights 1, reference = adapters off on both sides, AdamW; the base in fp32, bf16 or NF4 "
        "(bitsandbytes 4-bit, bf16 compute and storage, double quantization; the same codes on both "
        "sides), adapters fp32 on both sides (checked), no autocast. "
        f"{REPS} interleaved repetitions after {WARMUP} warm-up steps; medians; one process.", "",
        *vs_trl_table(res["rows"]), "",
        "TRL's step here is `KTOTrainer._compute_loss` + backward + AdamW (its dataset preparation, "
        "accelerate and logging loop are not timed). Both sides run four forwards a step (policy and "
        "reference, on the examples and on the mismatched KL rows; the policy's KL forward without "
        "gradient). TRL's fused LM head also computes, for its logs, the entropy and mean logit at "
        "every position over the whole vocabulary; rankwise normalises the vocabulary only at "
        "completion positions (read from TRL 1.16's code, not profiled). The machine is shared with "
        "other jobs: the ratio of the two, measured in the same process and interleaved, is the "
        "figure to read.", "",
        f"Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}, "
        f"trl {v['trl']}, bitsandbytes {v['bitsandbytes']}, {v['cpu_count']} CPUs. "
        f"Last run {res['wall_s']:.0f} s.", ""])


__all__ = ["run"]
