"""Benchmark: the ``grpo`` task on a rankwise LoRA against TRL's ``GRPOTrainer`` on a PEFT LoRA
(``rankwise bench grpo``).

Setup (both sides identical): the 4-layer, 128-wide Llama of ``bench dpo`` (30k vocabulary), LoRA
r=8, alpha=16 on ``q_proj``/``k_proj``/``v_proj``/``o_proj`` with PEFT's adapter copied from
rankwise's, 4 stdlib docstring prompts per step with G=8 completions each, beta 0.04, loss
``dapo``, reward ``length-penalty`` (characters / 200: it differs within every group), ``torch.optim.AdamW``.

The completions are *injected*, not sampled (half are the function's real ``def`` line, half
random tokens of random lengths): sampling is transformers' ``generate`` on both
sides and is left out. One step is scoring + group advantages + the adapters-off reference forward
+ the policy forward and loss + backward + AdamW: rankwise's ``GRPOTask.rollout`` +
``loss_sum``; TRL's ``_generate_and_score_completions`` (its ``_generate`` replaced by the same
completions) + ``_compute_loss``. The two alternate (order flipped every repetition) after warm-up;
time is process CPU time with one torch thread (the machine is shared), memory the peak bytes of
live tensors one step adds (:mod:`rankwise.memory`). Losses of every timed step must agree.
"""
from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from rankwise.testing import same_factors
from rankwise_bench.dpo import (BASES, _base, check_fp32_adapters, fp32_adapters, interleaved, measured_rows,
                                record_rows, vs_trl_table)

R, ALPHA, TARGETS = 8, 16.0, ["q_proj", "k_proj", "v_proj", "o_proj"]
PROMPTS, G, MAX_NEW, BETA, LR = 4, 8, 32, 0.04, 1e-4
WARMUP, REPS = 2, 6


def _batches(tok, steps: int, per_step: int = PROMPTS, group: int = G):
    """Per step: ``per_step`` prompt ids, ``group`` completion ids each (half real def lines, half
    random), texts (``bench rloo`` draws the same)."""
    from rankwise.data.instruct import load_function_records
    recs = load_function_records()
    g = torch.Generator().manual_seed(0)
    out = []
    for s in range(steps):
        chosen = recs[s * per_step:(s + 1) * per_step]
        prompts = [tok(" ".join(r["prompt"].split()[:40]), add_special_tokens=False)["input_ids"] for r in chosen]
        comps = []
        for r in chosen:
            real = tok(r["completion"], add_special_tokens=False)["input_ids"][: MAX_NEW - 1] + [tok.eos_token_id]
            for k in range(group):
                n = int(torch.randint(4, MAX_NEW, (1,), generator=g))
                comps.append(real if k % 2 == 0 else torch.randint(1000, len(tok), (n,), generator=g).tolist())
        out.append((prompts, comps, [r["prompt"] for r in chosen]))
    return out


def _build(tok, tmp: Path, kind: str = "float32"):
    import peft
    import trl
    from datasets import Dataset

    from rankwise.adapters.lora import LoraConfig, apply_lora
    from rankwise.tasks.grpo.rewards import length_penalty
    ours = _base(len(tok), kind)  # bf16 / NF4: the base only; both sides keep fp32 adapters
    apply_lora(ours, LoraConfig(r=R, alpha=ALPHA, targets=TARGETS, dropout=0.0))
    args = trl.GRPOConfig(output_dir=str(tmp), beta=BETA, loss_type="dapo", num_generations=G,
                          per_device_train_batch_size=PROMPTS * G, max_completion_length=MAX_NEW,
                          report_to=[], use_cpu=True, bf16=False, fp16=False)
    trainer = trl.GRPOTrainer(model=_base(len(tok), kind), reward_funcs=length_penalty(200), args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["a"]}), processing_class=tok,
                              peft_config=peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS,
                                                          lora_dropout=0.0))
    trainer.current_gradient_accumulation_steps = 1
    fp32_adapters(trainer.model)
    same_factors(ours, trainer.model)
    return ours.train(), trainer


def _steps(ours, trainer, tok, batches):
    from rankwise.tasks.grpo.data import PromptData
    from rankwise.tasks.grpo.task import GRPOConfig, GRPOTask
    task = GRPOTask(GRPOConfig(rewards=["length-penalty"], num_generations=G, max_completion_length=MAX_NEW,
                               beta=BETA, loss_type="dapo"))
    opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=LR)
    theirs = trainer.model.train()
    topt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=LR)

    def mine(k: int) -> float:
        prompts, comps, texts = batches[k]
        data = PromptData(prompts, texts, {}, list(range(1, PROMPTS + 1)), tok.pad_token_id, tok)
        task.prepare(ours, [data], False, PROMPTS, "cpu")
        rolled = task.rollout(ours, task.collate([data[i] for i in range(PROMPTS)], tok.pad_token_id), comps)
        total, _ = task.loss_sum(ours, rolled)
        loss = total / task.count_targets(rolled)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        task.samples.clear()
        return float(loss.detach())

    def trl_step(k: int) -> float:
        prompts, comps, texts = batches[k]
        words = [tok.decode(c, skip_special_tokens=True) for c in comps]
        n = PROMPTS * G
        trainer._generate = lambda ps: ([prompts[i // G] for i in range(n)], comps, None, words, None, {},
                                        None, [None] * n)
        scored = trainer._generate_and_score_completions([{"prompt": texts[i // G]} for i in range(n)])
        loss = trainer._compute_loss(theirs, scored)
        loss.backward()
        topt.step()
        topt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return mine, trl_step


def _measure(tok, batches, kind: str) -> dict:
    """One row: both sides on a base of ``kind`` (adapters fp32 on both), interleaved."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ours, trainer = _build(tok, Path(tmp), kind)
        check_fp32_adapters(ours, trainer.model)
        return interleaved(*_steps(ours, trainer, tok, batches), WARMUP, REPS)


def run(out: Path) -> dict:
    """Run the benchmark (fp32, bf16 and NF4 bases; rows already in ``out`` of the same setup are
    kept) and write ``out/results.json`` and ``results.md`` after each row."""
    import json

    from rankwise.errors import require
    from rankwise.recipes.model import load_tokenizer
    for module in ("peft", "trl", "bitsandbytes"):
        require(module, "bench", "rankwise bench grpo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    setup = {"prompts": PROMPTS, "num_generations": G, "max_completion_length": MAX_NEW, "r": R,
             "alpha": ALPHA, "targets": TARGETS, "beta": BETA, "loss_type": "dapo", "base_dtypes": list(BASES)}
    rows = measured_rows(out, setup)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        tok = copy.deepcopy(load_tokenizer("tiny-llama"))
        tok.eos_token = tok.eos_token or tok.sep_token
        batches = _batches(tok, WARMUP + REPS + 1)
        record_rows(out, rows, setup, start, lambda kind: _measure(tok, batches, kind), markdown)
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "results.json").read_text())


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    v = res["versions"]
    return "\n".join([
        "# GRPO: rankwise LoRA + grpo task vs TRL GRPOTrainer + PEFT LoRA", "",
        "Command: `OMP_NUM_THREADS=1 flock /tmp/bench.lock rankwise bench grpo --out bench/results/grpo`", "",
        f"4-layer 128-wide Llama (30k vocabulary), LoRA r={R} alpha={ALPHA:g} on {'/'.join(TARGETS)}, "
        f"{PROMPTS} docstring prompts x G={G} injected completions (up to {MAX_NEW} tokens) per step, "
        f"loss dapo, beta={BETA}, reward length-penalty, reference = adapters off on both sides, "
        "adapters fp32 on both sides (the base in the row's dtype, no autocast; NF4: bitsandbytes "
        "4-bit, bf16 compute and storage, double quantization, the same codes on both sides, TRL's "
        f"own cast of adapters to bf16 on a quantized base undone), AdamW. {REPS} "
        f"interleaved repetitions after {WARMUP} warm-up steps; medians; one process.", "",
        *vs_trl_table(res["rows"], "before NF4 was added"), "",
        "Sampling is left out on both sides (both call transformers' `generate`); the step is scoring, "
        "advantages, the reference forward, the policy forward + loss, backward and AdamW. TRL's "
        "trainer loop, accelerate and logging are not timed. The machine is shared with other jobs: "
        "the ratio of the two, measured in the same process and interleaved, is the figure to read. "
        "NF4 runs bitsandbytes' CPU path (this machine has avx512_bf16; CI machines without it "
        "take another path). Rows measured in different runs are marked with their time.", "",
        f"Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}, "
        f"trl {v['trl']}, bitsandbytes {v.get('bitsandbytes', '?')}, {v['cpu_count']} CPUs. "
        f"Last run {res['wall_s']:.0f} s.", ""])


__all__ = ["run"]
