"""Measurement: GRPO raises the greedy reward over its SFT start model on ``stdlib-functions``,
and GAIN-RL's order against uniform sampling (quality only; ``docs/preference-rl.md``).

Decision (issue 35 item 2): the claim needs a *pretrained* causal LM that earns a non-zero
reward from its own completions, so the benchmark starts from the reference base
(:func:`rankwise_bench.common.reference_base`, a 6.45M-parameter Llama pretrained on the
standard library, with its SentencePiece tokenizer); the earlier random-weight model and its
synthetic ``a + b =`` copy task are gone.

Task: ``stdlib-functions`` (prompt: the first ``PROMPT_WORDS`` words of a function's docstring;
completion: its ``def`` line). Reward: ``rankwise.data.instruct:def_line_reward`` -- 1.0 when
the completion's first line parses as a ``def`` line naming the record's function, read from the
completion alone (the record's ``id`` names the function). Records are split once, spread over the
packages: ``RL`` GRPO training prompts, ``EVAL`` held-out evaluation prompts, the rest SFT data.

SFT start (one for every row): rankwise fully fine-tunes the reference base on the SFT records
(prompt-completion, ``SFT_STEPS`` steps of 16, AdamW ``SFT_LR``), and its merged export is
GRPO's base. GRPO: LoRA r=8 on every linear layer, G=8, 8 prompts per step, at most
``NEW_TOKENS`` new tokens sampled at ``TEMPERATURE`` (0.7: at 1.0 the SFT model's sampled
reward was 0.016 against 0.16 greedy, so almost no group had a reward to compare), beta 0.04,
loss ``dapo``, AdamW ``lr``, ``steps`` steps; the greedy reward on the ``EVAL`` held-out prompts
every ``EVERY`` steps (``eval_reward_mean``: generalisation, not memorisation). "Steps to reach" = the first evaluated step whose reward is at
least the SFT start + ``GAIN`` (an absolute gain fixed before the runs); "mean over the curve" =
the mean evaluated reward after step 0 (an area under the curve: a faster order scores higher).
A gain-rl run also records its sampler's centre after each loop (a position in the sorted list
of ``RL`` prompts; from the final checkpoint).
"""
from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from rankwise_bench.common import reference_base, write_json, write_results

RL, EVAL, PROMPT_WORDS = 128, 64, 32
SFT_STEPS, SFT_LR = 200, 5e-4
STEPS, EVERY, GAIN, NEW_TOKENS, POOL, TEMPERATURE = 32, 4, 0.05, 24, 32, 0.7
SEEDS = (0, 1, 2)
REWARD = "rankwise.data.instruct:def_line_reward"


def split_records() -> dict[str, list[dict]]:
    """``{"sft", "rl", "eval"}``: disjoint stdlib-functions records, prompts cut to
    ``PROMPT_WORDS`` words; ``rl`` and ``eval`` are every k-th record (spread over the packages)."""
    from rankwise.data.instruct import load_function_records
    recs = [{"prompt": " ".join(r["prompt"].split()[:PROMPT_WORDS]) + "\n", "completion": r["completion"],
             "id": r["id"]} for r in load_function_records()]
    step = len(recs) // (RL + EVAL)
    picked = list(range(0, step * (RL + EVAL), step))   # every step-th record: RL + EVAL of them
    held = set(picked)
    return {"sft": [r for i, r in enumerate(recs) if i not in held],
            "rl": [recs[i] for k, i in enumerate(picked) if k % 3 != 0],     # 2 of every 3 picked
            "eval": [recs[i] for k, i in enumerate(picked) if k % 3 == 0]}


def _files(work: Path) -> dict[str, Path]:
    """The three splits as JSONL files in ``work``."""
    out = {}
    for name, recs in split_records().items():
        out[name] = work / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in recs))
    return out


def _sft(work: Path, files: dict[str, Path]) -> tuple[Path, dict]:
    """The SFT start model (merged export of a full fine-tune of the reference base) and its record."""
    from rankwise.recipes.config import load_run_config
    from rankwise.recipes.export import export_run
    from rankwise.recipes.train import train
    out = work / "sft-model"
    info_path = work / "sft.json"
    if (out / "config.json").exists() and info_path.exists():
        return out, json.loads(info_path.read_text())
    raw = {"model": {"path": str(reference_base())}, "task": {"name": "causal-lm"},
           "data": {"source": str(files["sft"]), "eval_source": str(files["eval"]), "format": "prompt-completion",
                    "max_length": 96},
           "method": {"name": "full"}, "optim": {"name": "adamw", "lr": SFT_LR},
           "train": {"steps": SFT_STEPS, "batch_size": 16, "eval_batch_size": 64, "eval_every": 0,
                     "save_every": 100000, "log_every": 10, "progress": False, "threads": 1, "seed": 0}}
    shutil.rmtree(work / "sft", ignore_errors=True)
    metrics = train(load_run_config(None, base=raw), work / "sft", summary=False)
    export_run(work / "sft", "merged", out)
    info = {"steps": SFT_STEPS, "lr": SFT_LR, "records": len(split_records()["sft"]),
            "eval_loss": metrics.get("eval_loss")}
    write_json(info_path, info)
    shutil.rmtree(work / "sft", ignore_errors=True)
    return out, info


def _raw(model: Path, files: dict[str, Path], order: str, seed: int, lr: float, steps: int) -> dict:
    return {"model": {"path": str(model)},
            "data": {"source": str(files["rl"]), "eval_source": str(files["eval"]), "max_length": 96,
                     "order": {"name": order, "pool": POOL} if order == "gain-rl" else order},
            "method": {"name": "lora", "r": 8, "alpha": 16, "targets": "all-linear"},
            "optim": {"name": "adamw", "lr": lr},
            "task": {"name": "grpo", "rewards": [REWARD], "num_generations": 8,
                     "max_completion_length": NEW_TOKENS, "temperature": TEMPERATURE},
            "train": {"steps": steps, "batch_size": 8, "eval_batch_size": 64, "eval_every": EVERY,
                      "save_every": 1000, "log_every": 1, "progress": False, "seed": seed, "threads": 1,
                      "warmup_fraction": 0.0}}


def _centre(run_dir: Path) -> list[float]:
    """The GAIN-RL sampler's centre after each loop, from the run's last checkpoint."""
    import torch

    from rankwise.recipes.checkpoint import list_checkpoints
    state = torch.load(list_checkpoints(run_dir)[-1] / "state.pt", weights_only=False)
    return [round(float(m), 2) for m in state["schedule"]["history"]]


def _one(work: Path, model: Path, files: dict[str, Path], order: str, seed: int, lr: float, steps: int) -> dict:
    """One GRPO run from the SFT start: its greedy-reward curve and summary."""
    from rankwise.recipes.config import load_run_config
    from rankwise.recipes.session import prepare
    from rankwise.recipes.train import train
    raw = _raw(model, files, order, seed, lr, steps)
    start = prepare(load_run_config(None, base=json.loads(json.dumps(raw)))).evaluate()["eval_reward_mean"]
    run_dir = work / f"{order}-{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    train(load_run_config(None, base=json.loads(json.dumps(raw))), run_dir, summary=False)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    curve = [[0, start]] + [[e["step"], e["eval_reward_mean"]] for e in events if "eval_reward_mean" in e]
    curve = [list(x) for x in sorted(dict((s, r) for s, r in curve).items())]
    rewards = [(e["step"], e["reward"]) for e in events if "reward" in e]
    row = {"start": start, "final": curve[-1][1], "curve": curve,
           "steps_to_target": next((s for s, r in curve if r >= start + GAIN), None),
           "curve_mean": statistics.fmean(r for s, r in curve if s > 0),
           "train_reward_first5": statistics.fmean(r for s, r in rewards[:5]),
           "train_reward_last5": statistics.fmean(r for s, r in rewards[-5:])}
    if order == "gain-rl":
        row["centre"] = _centre(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


def run(out: Path, lr: float = 3e-3, steps: int = STEPS, seeds: int = len(SEEDS)) -> dict:
    """Train every (seed, order) with GRPO's AdamW ``lr`` for ``steps`` steps from one SFT start;
    write ``out/results.json`` after each run (a rerun skips the recorded ones) and ``results.md``."""
    out = Path(out)
    work = out / "_work"
    work.mkdir(parents=True, exist_ok=True)
    files = _files(work)
    model, sft = _sft(work, files)
    rec_path = out / "results.json"
    rows = json.loads(rec_path.read_text()).get("runs", {}) if rec_path.exists() else {}
    for seed in SEEDS[:seeds]:
        for order in ("uniform", "gain-rl"):
            key = f"{order}/{seed}"
            if key not in rows:
                rows[key] = _one(work, model, files, order, seed, lr, steps)
                write_json(rec_path, {"runs": rows})
    res = {"task": "stdlib-functions", "base": "bench/reference-base/model", "sft": sft, "runs": rows,
           "gain": GAIN, "steps": steps, "lr": lr, "every": EVERY, "rl_prompts": RL, "eval_prompts": EVAL,
           "prompt_words": PROMPT_WORDS, "new_tokens": NEW_TOKENS, "temperature": TEMPERATURE, "pool": POOL,
           "seeds": list(SEEDS[:seeds]), "out": str(out)}
    write_results(out, res, markdown(res))
    shutil.rmtree(work, ignore_errors=True)  # weights and run folders are not results
    return res


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    runs = res["runs"]
    lines = ["# GRPO and GAIN-RL on stdlib-functions from the reference base (quality only)", "",
             f"Command: `OMP_NUM_THREADS=1 flock /tmp/core2.lock rankwise bench grpo-gain --out {res['out']} "
             f"--lr {res['lr']} --steps {res['steps']}`", "",
             f"Prompts: the first {res['prompt_words']} words of a stdlib docstring; reward "
             f"`def_line_reward` (the completion's `def` line names the record's function); greedy reward "
             f"on {res['eval_prompts']} held-out prompts. Start model: the reference base fully "
             f"fine-tuned by rankwise for {res['sft']['steps']} SFT steps (AdamW {res['sft']['lr']}, "
             f"{res['sft']['records']} records; held-out completion loss {res['sft']['eval_loss']:.3f}), the "
             f"same for every row. GRPO: {res['rl_prompts']} training prompts, LoRA r=8, G=8, 8 prompts/step, "
             f"at most {res['new_tokens']} new tokens sampled at temperature {res['temperature']}, "
             f"AdamW {res['lr']}, {res['steps']} steps, evaluated "
             f"every {res['every']}; GAIN-RL pool {res['pool']}. Steps to reach = first evaluated step with "
             f"reward >= start + {res['gain']} (None: not reached); curve mean = mean evaluated reward "
             "after step 0.", "",
             "| order | seed | SFT start | final | curve mean | steps to reach | train reward first 5 → last 5 |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for key in sorted(runs):
        r = runs[key]
        order, seed = key.split("/")
        lines.append(f"| {order} | {seed} | {r['start']:.3f} | {r['final']:.3f} | {r['curve_mean']:.3f} | "
                     f"{r['steps_to_target']} | {r['train_reward_first5']:.3f} → {r['train_reward_last5']:.3f} |")
    for order in ("uniform", "gain-rl"):
        rs = [runs[k] for k in sorted(runs) if k.startswith(order + "/")]
        if rs:
            lines.append(f"| {order} mean | | {statistics.fmean(r['start'] for r in rs):.3f} | "
                         f"{statistics.fmean(r['final'] for r in rs):.3f} | "
                         f"{statistics.fmean(r['curve_mean'] for r in rs):.3f} | "
                         f"{[r['steps_to_target'] for r in rs]} | |")
    centres = [(k, runs[k]["centre"]) for k in sorted(runs) if "centre" in runs[k]]
    if centres:
        lines += ["", f"GAIN-RL's centre (position in the sorted {res['rl_prompts']} prompts) after each "
                  "sampler loop:", ""]
        lines += [f"- seed {k.split('/')[1]}: " + ", ".join(f"{m:g}" for m in c) for k, c in centres]
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench grpo-gain --out DIR [--lr LR] [--steps N] [--seeds N]``."""
    from rankwise_bench.common import keyword_main
    return keyword_main(run, argv, "grpo-gain", lr=(float, 3e-3), steps=(int, STEPS), seeds=(int, len(SEEDS)))


__all__ = ["main", "markdown", "run", "split_records"]
