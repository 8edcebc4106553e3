"""Measurement: GRPO raises the mean reward over its SFT start model, and GAIN-RL's order
against uniform sampling, on a synthetic task (quality only; ``docs/preference-rl.md``).

Task: prompts ``a + b =`` for the 100 digit pairs, answer ``b`` (the digit before ``=``), reward
``exact-match``; a 2-layer, 64-wide Llama with a 14-token word-level vocabulary (digits, ``+``,
``=``, pad, EOS). Why synthetic: a model that earns a non-zero reward on ``stdlib-functions``
needs an SFT stage on a real LM, which did not fit this session; ``(a + b) mod 10`` was tried
first and neither SFT (150 steps) nor GRPO (60 steps) left the 1/10 guess. The SFT start model:
rankwise fine-tunes the random model (method ``full``, AdamW 3e-3, 16 examples per step) for
``SFT_STEPS`` steps on ``a + b = b`` completions, so it answers about half the prompts, then the
merged export is GRPO's base. GRPO: LoRA r=8 on every linear layer, G=8, 8 prompts per step, at
most 2 new tokens, beta 0.04, loss ``dapo``, AdamW ``lr`` (1e-2; 3e-3 in a second run), ``STEPS`` steps, greedy reward on the
same 100 prompts every ``EVERY`` steps (``eval_reward_mean``: whether the optimisation works, not
generalisation). "Steps to reach" = the first evaluated step whose reward is >= ``TARGET``.
A gain-rl run also records its sampler's centre after each loop (``centre``, a position in the
sorted list of 100 prompts; from the final checkpoint), which moves on the loop's accuracy and
online angle (``docs/preference-rl.md``).
"""
from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from rankwise_bench.common import llama, write_json, write_results

SFT_STEPS, STEPS, EVERY, TARGET = 12, 40, 5, 0.8
SEEDS = (0, 1, 2)


def _model_folder(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "+": 2, "=": 3, **{str(d): 4 + d for d in range(10)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    model = llama(len(vocab), 64, 2, 4, 128, kv_heads=2, positions=32, seed=0, pad_token_id=0,
                  bos_token_id=1, eos_token_id=1)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _data(folder: Path) -> Path:
    path = folder / "copy.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a} + {b} =", "completion": f" {b}", "answer": str(b)})
                            + "\n" for a in range(10) for b in range(10)))
    return path


def _sft(work: Path, data: Path) -> Path:
    """The SFT start model (merged export of a short full fine-tune)."""
    from rankwise.recipes.config import load_run_config
    from rankwise.recipes.export import export_run
    from rankwise.recipes.train import train
    out = work / "sft-model"
    if (out / "config.json").exists():
        return out
    base = _model_folder(work / "random-model")
    raw = {"model": {"path": str(base)}, "task": {"name": "causal-lm"},
           "data": {"source": str(data), "eval_source": str(data), "format": "prompt-completion", "max_length": 8},
           "method": {"name": "full"}, "optim": {"name": "adamw", "lr": 0.003},
           "train": {"steps": SFT_STEPS, "batch_size": 16, "eval_batch_size": 100, "save_every": 1000,
                     "progress": False}}
    shutil.rmtree(work / "sft", ignore_errors=True)
    train(load_run_config(None, base=raw), work / "sft")
    export_run(work / "sft", "merged", out)
    return out


def _raw(model: Path, data: Path, order: str, seed: int, lr: float = 0.01, steps: int = STEPS) -> dict:
    return {"model": {"path": str(model)},
            "data": {"source": str(data), "eval_source": str(data), "max_length": 8, "order": order},
            "method": {"name": "lora", "r": 8, "alpha": 16, "targets": "all-linear"},
            "optim": {"name": "adamw", "lr": lr},
            "task": {"name": "grpo", "rewards": ["exact-match"], "num_generations": 8,
                     "max_completion_length": 2, "gain_rl": {"pool": 32}},
            "train": {"steps": steps, "batch_size": 8, "eval_batch_size": 100, "eval_every": EVERY,
                      "save_every": 1000, "log_every": 1, "progress": False, "seed": seed,
                      "warmup_fraction": 0.0}}


def _centre(run_dir: Path) -> list[float]:
    """The GAIN-RL sampler's centre after each loop, from the run's last checkpoint."""
    import torch

    from rankwise.recipes.checkpoint import list_checkpoints
    state = torch.load(list_checkpoints(run_dir)[-1] / "state.pt", weights_only=False)
    return [round(float(m), 2) for m in state["schedule"]["history"]]


def run(out: Path, lr: float = 0.01, steps: int = STEPS) -> dict:
    """Train every (seed, order) with GRPO's AdamW ``lr`` for ``steps`` steps; write
    ``out/results.json`` (after each run) and ``results.md``."""
    from rankwise.recipes.config import load_run_config
    from rankwise.recipes.train import train
    from rankwise.recipes.session import prepare
    out = Path(out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    data = _data(work)
    model = _sft(work, data)
    rec_path = out / "results.json"
    rows = json.loads(rec_path.read_text()).get("runs", {}) if rec_path.exists() else {}
    for seed in SEEDS:
        for order in ("uniform", "gain-rl"):
            key = f"{order}/{seed}"
            if key in rows:
                continue
            raw = _raw(model, data, order, seed, lr, steps)
            start = prepare(load_run_config(None, base=json.loads(json.dumps(raw)))).evaluate()["eval_reward_mean"]
            run_dir = work / key.replace("/", "-")
            shutil.rmtree(run_dir, ignore_errors=True)
            train(load_run_config(None, base=json.loads(json.dumps(raw))), run_dir)
            events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
            curve = [[0, start]] + [[e["step"], e["eval_reward_mean"]] for e in events if "eval_reward_mean" in e]
            curve = [list(x) for x in sorted(dict((s, r) for s, r in curve).items())]
            reach = next((s for s, r in curve if r >= TARGET), None)
            rows[key] = {"start": start, "final": curve[-1][1], "curve": curve, "steps_to_target": reach,
                         "train_reward_first5": statistics.mean(e["reward"] for e in events if "reward" in e
                                                                and e["step"] <= 5)}
            if order == "gain-rl":
                rows[key]["centre"] = _centre(run_dir)
            write_json(rec_path, {"runs": rows})
    res = {"runs": rows, "target": TARGET, "steps": steps, "lr": lr, "every": EVERY, "sft_steps": SFT_STEPS,
           "seeds": list(SEEDS), "out": str(out)}
    write_results(out, res, markdown(res))
    shutil.rmtree(work, ignore_errors=True)  # weights and run folders are not results
    return res


def markdown(res: dict, out: str | None = None) -> str:
    """``results.md`` from the record.

    Args:
        res: The record.
        out: The results folder, for a record made before ``res`` kept it (and ``lr``: such a
            run took :func:`run`'s defaults).
    """
    runs = res["runs"]
    options = f" --lr {res['lr']} --steps {res['steps']}" if "lr" in res else ""
    lines = ["# GRPO and GAIN-RL on a synthetic copy task (quality only)", "",
             f"Command: `OMP_NUM_THREADS=1 flock /tmp/bench2.lock rankwise bench grpo-gain --out "
             f"{res.get('out', out)}{options}`", "",
             f"Prompts `a + b =`, answer b, reward exact-match, greedy reward on the 100 training "
             f"prompts. Start model: a random 2-layer 64-wide Llama fine-tuned by rankwise for "
             f"{res['sft_steps']} SFT steps. GRPO: LoRA r=8, G=8, 8 prompts/step, "
             + (f"AdamW {res['lr']}, " if "lr" in res else "") + f"{res['steps']} steps, "
             f"evaluated every {res['every']}. Steps to reach = first evaluated step with reward >= "
             f"{res['target']} (None: not reached).", "",
             "| order | seed | SFT start reward | final reward | steps to reach |", "|---|---:|---:|---:|---:|"]
    for key in sorted(runs):
        r = runs[key]
        order, seed = key.split("/")
        lines.append(f"| {order} | {seed} | {r['start']:.2f} | {r['final']:.2f} | {r['steps_to_target']} |")
    for order in ("uniform", "gain-rl"):
        rs = [runs[k] for k in runs if k.startswith(order + "/")]
        if rs:
            reach = [r["steps_to_target"] for r in rs]
            lines.append(f"| {order} mean | | {statistics.mean(r['start'] for r in rs):.2f} | "
                         f"{statistics.mean(r['final'] for r in rs):.2f} | {reach} |")
    centres = [(k, runs[k]["centre"]) for k in sorted(runs) if "centre" in runs[k]]
    if centres:
        lines += ["", "GAIN-RL's centre (position in the sorted 100 prompts) after each sampler loop:", ""]
        lines += [f"- seed {k.split('/')[1]}: " + ", ".join(f"{m:g}" for m in c) for k, c in centres]
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench grpo-gain --out DIR [--lr LR] [--steps N]``."""
    from rankwise_bench.common import keyword_main
    return keyword_main(run, argv, "grpo-gain", lr=(float, 0.01), steps=(int, STEPS))


__all__ = ["main", "markdown", "run"]
