"""Benchmark: the ``rloo`` task on a rankwise LoRA against TRL's ``RLOOTrainer`` on a PEFT LoRA
(``rankwise bench rloo``).

Setup (both sides identical), ``bench grpo``'s: the 4-layer, 128-wide Llama of ``bench dpo`` (30k
vocabulary), LoRA r=8, alpha=16 on ``q_proj``/``k_proj``/``v_proj``/``o_proj`` with PEFT's adapter
copied from rankwise's, 4 stdlib docstring prompts per step with k=8 *injected* completions each
(:func:`rankwise_bench.grpo._batches`: half the function's real ``def`` line, half random tokens;
sampling is transformers' ``generate`` on both sides and is left out), beta 0.05 (TRL's default:
the KL penalty in the reward needs the sampling policy's and the reference's log-probs), reward
``length-penalty``, ``torch.optim.AdamW``.

One step is scoring + the policy's and the adapters-off reference's no-gradient forwards + the
leave-one-out advantages + the policy forward and loss + backward + AdamW: rankwise's
``RLOOTask.rollout`` + ``loss_sum``; TRL's ``_generate_and_score_completions`` (its ``_generate``
replaced by the same completions) + ``_compute_loss``. RLOO's loss is 0 in value at every step
(the advantages of a prompt sum to 0, the ratio is 1), so each side reports the norm of its LoRA
gradient before the AdamW step in place of the loss: the agreement line compares those. Timing,
memory and the interleaving are ``bench dpo``'s (:func:`rankwise_bench.dpo.interleaved`).
"""
from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from rankwise.testing import same_factors
from rankwise_bench.dpo import (BASES, _base, check_fp32_adapters, fp32_adapters, interleaved, measured_rows,
                                record_rows, vs_trl_table)
from rankwise_bench.grpo import ALPHA, LR, MAX_NEW, PROMPTS, R, REPS, TARGETS, WARMUP, _batches

K, BETA = 8, 0.05


def _grad_norm(params: list) -> float:
    return float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None)))


def _build(tok, tmp: Path, kind: str = "float32", rows: int = PROMPTS * K, k: int = K):
    import peft
    import trl
    from datasets import Dataset

    from rankwise.adapters.lora import LoraConfig, apply_lora
    from rankwise.tasks.grpo.rewards import length_penalty
    ours = _base(len(tok), kind)  # bf16 / NF4: the base only; both sides keep fp32 adapters
    apply_lora(ours, LoraConfig(r=R, alpha=ALPHA, targets=TARGETS, dropout=0.0))
    args = trl.RLOOConfig(output_dir=str(tmp), beta=BETA, num_generations=k, per_device_train_batch_size=rows,
                          max_completion_length=MAX_NEW, report_to=[], use_cpu=True, bf16=False, fp16=False)
    trainer = trl.RLOOTrainer(model=_base(len(tok), kind), reward_funcs=length_penalty(200), args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["a"]}), processing_class=tok,
                              peft_config=peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS,
                                                          lora_dropout=0.0))
    fp32_adapters(trainer.model)
    same_factors(ours, trainer.model)
    return ours.train(), trainer


def _steps(ours, trainer, tok, batches, k: int = K):
    """``(rankwise step, TRL step)``, each ``fn(step) -> LoRA gradient norm before AdamW``."""
    from rankwise.tasks.grpo.data import PromptData
    from rankwise.tasks.rloo.task import RLOOConfig, RLOOTask
    task = RLOOTask(RLOOConfig(rewards=["length-penalty"], num_generations=k, max_completion_length=MAX_NEW,
                               beta=BETA))
    mine_params = [p for p in ours.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(mine_params, lr=LR)
    theirs = trainer.model.train()
    their_params = [p for p in theirs.parameters() if p.requires_grad]
    topt = torch.optim.AdamW(their_params, lr=LR)

    def mine(step: int) -> float:
        prompts, comps, texts = batches[step]
        n = len(prompts)
        data = PromptData(prompts, texts, {}, list(range(1, n + 1)), tok.pad_token_id, tok)
        task.prepare(ours, [data], False, n, "cpu")
        rolled = task.rollout(ours, task.collate([data[i] for i in range(n)], tok.pad_token_id), comps)
        total, _ = task.loss_sum(ours, rolled)
        (total / task.count_targets(rolled)).backward()
        norm = _grad_norm(mine_params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        task.samples.clear()
        task.step_metrics()
        return norm

    def trl_step(step: int) -> float:
        prompts, comps, texts = batches[step]
        words = [tok.decode(c, skip_special_tokens=True) for c in comps]
        n = len(comps)
        trainer._generate = lambda ps: ([prompts[i // k] for i in range(n)], comps, words)
        scored = trainer._generate_and_score_completions([{"prompt": texts[i // k]} for i in range(n)])
        trainer._compute_loss(theirs, scored).backward()
        norm = _grad_norm(their_params)
        topt.step()
        topt.zero_grad(set_to_none=True)
        return norm
    return mine, trl_step


def _measure(tok, batches, kind: str) -> dict:
    """One row: both sides on a base of ``kind`` (adapters fp32 on both), interleaved."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ours, trainer = _build(tok, Path(tmp), kind)
        check_fp32_adapters(ours, trainer.model)
        return interleaved(*_steps(ours, trainer, tok, batches), WARMUP, REPS)


def tokenizer():
    """The benchmark's tokenizer (``tiny-llama``'s, with an EOS token)."""
    from rankwise.recipes.model import load_tokenizer
    tok = copy.deepcopy(load_tokenizer("tiny-llama"))
    tok.eos_token = tok.eos_token or tok.sep_token
    return tok


def run(out: Path) -> dict:
    """Run the benchmark (fp32, bf16 and NF4 bases; rows already in ``out`` of the same setup are
    kept) and write ``out/results.json`` and ``results.md`` after each row."""
    import json

    from rankwise.errors import require
    for module in ("peft", "trl", "bitsandbytes"):
        require(module, "bench", "rankwise bench rloo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    setup = {"prompts": PROMPTS, "num_generations": K, "max_completion_length": MAX_NEW, "r": R,
             "alpha": ALPHA, "targets": TARGETS, "beta": BETA, "base_dtypes": list(BASES)}
    rows = measured_rows(out, setup)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        tok = tokenizer()
        batches = _batches(tok, WARMUP + REPS + 1, PROMPTS, K)
        record_rows(out, rows, setup, start, lambda kind: _measure(tok, batches, kind), markdown)
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "results.json").read_text())


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    v = res["versions"]
    table = [line.replace("first-step loss", "first-step LoRA gradient norm") for line in vs_trl_table(res["rows"])]
    return "\n".join([
        "# RLOO: rankwise LoRA + rloo task vs TRL RLOOTrainer + PEFT LoRA", "",
        "Command: `OMP_NUM_THREADS=1 flock /tmp/bench.lock rankwise bench rloo --out bench/results/rloo`", "",
        f"4-layer 128-wide Llama (30k vocabulary), LoRA r={R} alpha={ALPHA:g} on {'/'.join(TARGETS)}, "
        f"{PROMPTS} docstring prompts x k={K} injected completions (up to {MAX_NEW} tokens) per step, "
        f"beta={BETA} (KL penalty in the reward), reward length-penalty, leave-one-out advantages, "
        "sequence-level loss, reference = adapters off on both sides, adapters fp32 on both sides (the "
        "base in the row's dtype, no autocast; NF4: bitsandbytes 4-bit, bf16 compute and storage, "
        "double quantization, the same codes on both sides, TRL's own cast of adapters to bf16 on a "
        f"quantized base undone), AdamW. {REPS} interleaved repetitions after {WARMUP} warm-up steps; "
        "medians; one process.", "",
        *table, "",
        "RLOO's loss is 0 in value at every step (the leave-one-out advantages of a prompt sum to 0 and "
        "the ratio is 1), so each side reports its LoRA gradient norm before the AdamW step instead: "
        "the line under the table compares those. Sampling is left out on both sides (both call "
        "transformers' `generate`); the step is scoring, the policy's and the reference's no-gradient "
        "forwards (the KL penalty), the advantages, the policy forward + loss, backward and AdamW. "
        "TRL's trainer loop, accelerate and logging are not timed. The machine is shared with other "
        "jobs: the ratio of the two, measured in the same process and interleaved, is the figure to read.", "",
        f"Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}, "
        f"trl {v['trl']}, bitsandbytes {v.get('bitsandbytes', '?')}, {v['cpu_count']} CPUs. "
        f"Last run {res['wall_s']:.0f} s.", ""])


__all__ = ["run"]
