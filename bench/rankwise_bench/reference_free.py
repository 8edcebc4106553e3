"""Benchmarks: the reference-free preference tasks on a rankwise LoRA against TRL's trainers on a
PEFT LoRA: ``rankwise bench orpo`` (``ORPOTrainer``) and ``rankwise bench simpo`` (``CPOTrainer``
with ``loss_type="simpo"``).

The setup of ``bench dpo`` (:mod:`rankwise_bench.dpo`): its 4-layer, 128-wide Llama with the
MiniLM tokenizer (30k vocabulary), LoRA r=8, alpha=16 on q/k/v/o, its 64 docstring -> ``def``-line
pairs up to 96 tokens, 8 pairs per step, AdamW, the base in fp32, bf16 or NF4 with fp32 adapters on
both sides, the two sides interleaved step by step, CPU time with one torch thread and the peak of
live tensors one step adds. The settings are TRL's defaults: ORPO ``beta`` (lambda) 0.1; SimPO
``beta`` 0.1, ``gamma`` 0.5, ``cpo_alpha`` 1 (the NLL term on).

One step is one forward (no reference on either side) + backward + AdamW. rankwise's is
:meth:`rankwise.engine.Engine.train_step`; TRL's is the trainer's ``get_batch_loss_metrics`` (its
forward, log-probs, NLL, loss and logged metrics) + ``backward`` + the same AdamW step on the same
token batch. TRL is handed the PEFT model PEFT builds from the same base (not a ``peft_config``):
on an NF4 base these trainers would otherwise run ``prepare_model_for_kbit_training``, which casts
the norms, embeddings and head to fp32 - another model than rankwise's. The first step's losses
must agree.
"""
from __future__ import annotations

import copy
import json
import tempfile
import time
from pathlib import Path

import torch

from rankwise.testing import same_factors
from rankwise_bench.dpo import (ALPHA, BASES, BATCH, LR, MAX_LEN, PAIRS, R, REPS, TARGETS, WARMUP, _base, _pairs,
                                check_fp32_adapters, fp32_adapters, interleaved, measured_rows, record_rows,
                                vs_trl_table)

SETTINGS = {  # task -> (our task section, TRL's config fields)
    "orpo": ({"name": "orpo", "beta": 0.1}, {"beta": 0.1}),
    "simpo": ({"name": "simpo", "loss": "simpo", "beta": 0.1, "gamma": 0.5, "cpo_alpha": 1.0},
              {"loss_type": "simpo", "beta": 0.1, "simpo_gamma": 0.5, "cpo_alpha": 1.0}),
}
TRAINERS = {"orpo": "ORPOTrainer", "simpo": "CPOTrainer"}


def trl_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our collated pair batch (chosen rows, then rejected) under the keys TRL's pair collator
    gives ``ORPOTrainer`` / ``CPOTrainer``."""
    b = batch["input_ids"].shape[0] // 2
    return {f"{side}_{key}": batch[key][rows] for side, rows in (("chosen", slice(0, b)), ("rejected", slice(b, None)))
            for key in ("input_ids", "attention_mask", "labels")}


def task_of(name: str):
    """Our task of benchmark ``name`` with its settings."""
    from rankwise import registry
    entry = registry.get("task", name)
    section = dict(SETTINGS[name][0])
    section.pop("name")
    return entry.builder(entry.config_cls(**section))


def trl_trainer(name: str, model, tok, tmp: Path):
    """TRL's trainer of benchmark ``name`` around the PEFT model ``model``."""
    from datasets import Dataset
    if name == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config, ORPOTrainer as Trainer
    else:
        from trl.experimental.cpo import CPOConfig as Config, CPOTrainer as Trainer
    args = Config(output_dir=str(tmp), report_to=[], use_cpu=True, bf16=False, fp16=False,
                  gradient_checkpointing=False, per_device_train_batch_size=BATCH, **SETTINGS[name][1])
    data = Dataset.from_dict({"prompt": ["a"], "chosen": [" b"], "rejected": [" c"]})
    return Trainer(model=model, args=args, train_dataset=data, processing_class=tok)


def _build(name: str, tok, tmp: Path, kind: str = "float32"):
    import peft

    from rankwise.adapters.lora import LoraConfig, apply_lora
    ours = _base(len(tok), kind)
    apply_lora(ours, LoraConfig(r=R, alpha=ALPHA, targets=TARGETS, dropout=0.0))
    peer = peft.get_peft_model(_base(len(tok), kind), peft.LoraConfig(
        r=R, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    fp32_adapters(peer)
    same_factors(ours, peer)
    return ours.train(), trl_trainer(name, peer, tok, tmp)


def _steps(name: str, ours, trainer, data):
    from rankwise.engine import Engine
    from rankwise.engine.loop import draw_batches
    task = task_of(name)
    opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=LR)
    engine = Engine(ours, task, opt, data, BATCH, seed=0)
    theirs = trainer.model.train()
    topt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=LR)

    def mine(k: int) -> float:
        return engine.train_step(k).loss

    def trl_step(k: int) -> float:
        batch = draw_batches(data, task, k, BATCH, 0, "cpu")[0]
        loss, _ = trainer.get_batch_loss_metrics(theirs, trl_batch(batch))
        loss.backward()
        topt.step()
        topt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return mine, trl_step


def _measure(name: str, tok, data, kind: str) -> dict:
    """One row: both sides on a base of ``kind`` (adapters fp32 on both), interleaved."""
    with tempfile.TemporaryDirectory() as tmp:
        ours, trainer = _build(name, tok, Path(tmp), kind)
        check_fp32_adapters(ours, trainer.model)
        return interleaved(*_steps(name, ours, trainer, data))


def run(out: Path, name: str) -> dict:
    """Run benchmark ``name`` (``orpo`` or ``simpo``; fp32, bf16 and NF4 bases; rows already in
    ``out`` of the same setup are kept) and write ``out/results.json`` and ``results.md`` after
    each row."""
    from rankwise.errors import require
    from rankwise.recipes.model import load_tokenizer
    for module in ("peft", "trl", "bitsandbytes"):
        require(module, "bench", f"rankwise bench {name}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    setup = {"task": SETTINGS[name][0], "pairs": PAIRS, "batch_pairs": BATCH, "max_length": MAX_LEN, "r": R,
             "alpha": ALPHA, "targets": TARGETS, "base_dtypes": list(BASES)}
    rows = measured_rows(out, setup)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        tok = copy.deepcopy(load_tokenizer("tiny-llama"))
        tok.eos_token = tok.eos_token or tok.sep_token  # TRL appends EOS; MiniLM's tokenizer ends with [SEP]
        data = _pairs(tok)
        record_rows(out, rows, setup, start, lambda kind: _measure(name, tok, data, kind), markdown)
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "results.json").read_text())


def run_orpo(out: Path) -> dict:
    """``rankwise bench orpo``: :func:`run` for ORPO."""
    return run(out, "orpo")


def run_simpo(out: Path) -> dict:
    """``rankwise bench simpo``: :func:`run` for SimPO."""
    return run(out, "simpo")


def markdown(res: dict) -> str:
    """``results.md`` from the record (either benchmark: ``setup.task`` names it)."""
    v, task = res["versions"], res["setup"]["task"]
    name = task["name"]
    settings = ", ".join(f"{k} {val:g}" if isinstance(val, float) else f"{k} {val}"
                         for k, val in task.items() if k != "name")
    return "\n".join([
        f"# {name.upper() if name == 'orpo' else 'SimPO'}: rankwise LoRA + {name} task vs TRL "
        f"{TRAINERS[name]} + PEFT LoRA", "",
        f"Command: `OMP_NUM_THREADS=1 flock /tmp/bench.lock rankwise bench {name} --out bench/results/{name}`", "",
        f"4-layer 128-wide Llama (30k vocabulary), LoRA r={R} alpha={ALPHA:g} on {'/'.join(TARGETS)}, "
        f"{res['setup']['pairs']} docstring -> def-line pairs up to {MAX_LEN} tokens, {BATCH} pairs per "
        f"step, task {name} ({settings}; TRL's defaults), no reference model on either side, AdamW; "
        "the base in fp32, bf16 or NF4 (bitsandbytes 4-bit, bf16 compute and storage, double "
        "quantization; the same codes on both sides), adapters fp32 on both sides (checked), no "
        f"autocast. {REPS} interleaved repetitions after {WARMUP} warm-up steps; medians; one process.", "",
        *vs_trl_table(res["rows"]), "",
        f"TRL's step here is `{TRAINERS[name]}.get_batch_loss_metrics` + backward + AdamW (its "
        "collator, accelerate and logging loop are not timed), on the PEFT model PEFT builds from the "
        "same base (handed to the trainer, so no `prepare_model_for_kbit_training` recasts the NF4 "
        "row's norms and head to fp32). Where the difference comes from (read from TRL 1.16's code, "
        "not profiled): TRL takes a log-softmax over the whole vocabulary at every position of both "
        "rows, and a second cross-entropy over the chosen rows for the NLL; rankwise normalises "
        "the vocabulary only at the target positions, once. With a bf16 or NF4 base TRL's "
        "cross-entropy (the NLL, a bf16 number) and log-softmax of the bf16 logits stay in bf16, "
        "rankwise's are taken in fp32: that, not the model, is the bf16 / NF4 rows' loss "
        "difference; the 1e-5 parity claim is the fp32 test's. The machine is shared with other jobs: "
        "the ratio of the two, measured in the same process and interleaved, is the figure to read. "
        "NF4 runs bitsandbytes' CPU path.", "",
        f"Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}, "
        f"trl {v['trl']}, bitsandbytes {v['bitsandbytes']}, {v['cpu_count']} CPUs. "
        f"Last run {res['wall_s']:.0f} s.", ""])


__all__ = ["run", "run_orpo", "run_simpo"]
