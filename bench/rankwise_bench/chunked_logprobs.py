"""Peak memory of the chunked completion log-probs (issue 38, item 7) in every task that reads
them (``dpo``, ``kto``, ``orpo``, ``simpo``, ``grpo``, ``rloo``), by the shared meter
(:mod:`rankwise.memory`): ``rankwise bench chunked-logprobs``.

Setup: the chunked-loss benchmark's Llama (2 layers, 64 wide, a 150,000-token vocabulary, so the
logits dominate; built in code, fp32), LoRA r=16 on every linear layer of the blocks, AdamW,
sequences of 1024 tokens (a 256-token prompt and 768-token completions, random token ids):

* **DPO**: one pair (2 rows), sigmoid loss, beta 0.1, the reference from the disabled adapters;
* **ORPO**, **SimPO**: the same pair at the tasks' defaults (no reference; ORPO's NLL covers the
  chosen prompt too, so its 256 prompt positions are scored as well);
* **KTO**: the pair's two completions as one desirable and one undesirable example (a batch of
  2: 2 rows with gradient, 2 mismatched KL rows and 4 reference rows without), beta 0.1;
* **GRPO**: one prompt, G = 2 completions (768 and 576 tokens) *injected* into the task's
  rollout (nothing is sampled: the memory of interest is the loss, not the decode loop), a
  reward on the completions' ids, beta 0.04 (so the reference forward runs), ``loss_type: dapo``;
* **RLOO**: GRPO's rows and reward, k = 2, beta 0.04 (the KL penalty in the reward: a
  no-gradient policy forward and the reference's).

Each task runs twice on equal starts through :meth:`rankwise.engine.Engine.train_step` (its
rollout, reference, loss, backward and AdamW step): ``loss_chunk_tokens`` 512 (what
``train.loss_chunk_tokens: auto`` gives at this vocabulary) and 0 (the full logits). After one
warm-up step (the optimizer state exists then) the next step is measured. Peak = bytes held
between steps (model + optimizer state) + the peak that step adds above them. The losses of the
measured step must agree (RLOO's is 0 in value: its advantages sum to 0 per prompt).
"""
from __future__ import annotations

import dataclasses
import platform
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise_bench.common import llama, ordered, write_results

GOAL = 0.30  # the chunked peak is at least this fraction below the unchunked one
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TASKS = ("dpo", "kto", "orpo", "simpo", "grpo", "rloo")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The benchmark's shape (the committed run uses the defaults)."""

    vocab: int = 150_000
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 176
    seq: int = 1024
    prompt: int = 256
    chunk_tokens: int = 512
    r: int = 16
    lr: float = 1e-4
    warmup: int = 1
    seed: int = 0


def _model(s: Sizes) -> nn.Module:
    from rankwise.adapters.lora import LoraConfig, apply_lora
    model = llama(s.vocab, s.hidden, s.layers, s.heads, s.intermediate, positions=s.seq, seed=s.seed,
                  pad_token_id=0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(s.seed + 1)
    apply_lora(model, LoraConfig(r=s.r, alpha=2.0 * s.r, targets=TARGETS, dropout=0.0))
    return model.train()


def _ids(n: int, s: Sizes, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, s.vocab, (n,), generator=g).tolist()


class _Ids:
    """Decodes ids to their decimal text (the reward reads completions as text); id 0 ends and pads."""

    eos_token_id = sep_token_id = pad_token_id = 0

    @staticmethod
    def decode(ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def _even_share(prompts, completions, **columns) -> list[float]:
    """A reward: the share of even token ids in the completion."""
    return [sum(int(t) % 2 == 0 for t in c.split()) / max(1, len(c.split())) for c in completions]


def _pair(s: Sizes) -> dict[str, list[int]]:
    prompt, width = _ids(s.prompt, s, 1), s.seq - s.prompt
    chosen, rejected = _ids(width, s, 2), _ids(width, s, 3)
    return {"chosen_ids": prompt + chosen, "chosen_labels": [-100] * s.prompt + chosen,
            "rejected_ids": prompt + rejected, "rejected_labels": [-100] * s.prompt + rejected}


def _pairs(name: str, s: Sizes):
    """``dpo``, ``orpo`` or ``simpo`` on the one pair: ``(task, data, batch size)``."""
    from rankwise.tasks.pairs import PairData
    from rankwise.tasks.dpo.task import DPOConfig, DPOTask
    from rankwise.tasks.orpo.task import ORPOTask
    from rankwise.tasks.simpo.task import SimPOTask
    task = {"dpo": lambda: DPOTask(DPOConfig(beta=0.1, reference="adapters-off")), "orpo": ORPOTask,
            "simpo": SimPOTask}[name]()
    return task, PairData([_pair(s)], 0), 1


def _kto(s: Sizes):
    from rankwise.tasks.kto.data import UnpairedData
    from rankwise.tasks.kto.task import KTOConfig, KTOTask
    pair = _pair(s)
    prompt = pair["chosen_ids"][:s.prompt]
    examples = [{"prompt_ids": prompt, "completion_ids": pair[f"{side}_ids"][s.prompt:], "label": side == "chosen"}
                for side in ("chosen", "rejected")]
    return KTOTask(KTOConfig(beta=0.1, reference="adapters-off")), UnpairedData(examples, 0, 0, s.seq), 2


def _sampled(name: str, s: Sizes):
    """``grpo`` or ``rloo`` with the two completions injected into its rollout."""
    from rankwise.tasks.grpo.data import PromptData
    from rankwise.tasks.grpo.task import GRPOConfig, GRPOTask
    from rankwise.tasks.rloo.task import RLOOConfig, RLOOTask
    width = s.seq - s.prompt
    injected = [_ids(width, s, 2), _ids(width * 3 // 4, s, 3)]  # unequal lengths: a non-zero loss
    base, config = (GRPOTask, GRPOConfig(rewards=["length-penalty"], num_generations=2, max_completion_length=width,
                                         beta=0.04, loss_type="dapo")) if name == "grpo" else \
        (RLOOTask, RLOOConfig(rewards=["length-penalty"], num_generations=2, max_completion_length=width, beta=0.04))

    class Injected(base):
        def rollout(self, model, batch, completions=None):
            return super().rollout(model, batch, completions=injected)

    task = Injected(config)
    task.fns = {"even-share": _even_share}
    return task, PromptData([_ids(s.prompt, s, 1)], ["p"], {}, [1], 0, _Ids()), 1


def _task(name: str, s: Sizes):
    """``(task, data, batch size)`` of the benchmark's task ``name``."""
    if name == "kto":
        return _kto(s)
    return _sampled(name, s) if name in ("grpo", "rloo") else _pairs(name, s)


def measure(name: str, s: Sizes, chunk: int) -> dict[str, Any]:
    """One side: ``name``'s task with ``loss_chunk_tokens = chunk``, a warm-up step, then the
    measured step's held bytes, step peak, loss and process CPU time."""
    from rankwise.core.quant import model_bytes
    from rankwise.engine import Engine
    from rankwise.memory import PeakMemory, tensor_bytes
    model = _model(s)
    task, data, batch = _task(name, s)
    task.loss_chunk_tokens = chunk
    task.prepare(model, [data], False, batch, "cpu")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=s.lr)
    engine = Engine(model, task, opt, data, batch, seed=s.seed)
    for k in range(s.warmup):
        engine.train_step(k)
    held = model_bytes(model) + tensor_bytes(dict(opt.state))
    t0 = time.process_time()
    with PeakMemory("cpu") as mem:
        loss = engine.train_step(s.warmup).loss
    return {"held_bytes": held, "step_peak_bytes": mem.peak_bytes, "peak_bytes": held + mem.peak_bytes,
            "loss": float(loss), "step_cpu_s": time.process_time() - t0}


def measure_all(s: Sizes = Sizes()) -> dict[str, Any]:
    """Both tasks, chunked and unchunked, with the savings and loss differences."""
    out: dict[str, Any] = {"sizes": dataclasses.asdict(s),
                           "logits_fp32_bytes_per_row": s.seq * s.vocab * 4}
    for name in TASKS:
        sides = {"chunked": measure(name, s, s.chunk_tokens), "unchunked": measure(name, s, 0)}
        sides["saving"] = 1 - sides["chunked"]["peak_bytes"] / sides["unchunked"]["peak_bytes"]
        sides["loss_abs_diff"] = abs(sides["chunked"]["loss"] - sides["unchunked"]["loss"])
        out[name] = sides
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


VERSIONS = ("python", "torch", "transformers")


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    s = res["sizes"]
    lines = ["# Chunked completion log-probs (issue 38, item 7): every preference and RL task", "",
             f"Command: `{res['command']}` ({res['timer']}; meter `{res['meter']}`).", "",
             f"Llama {s['layers']}x{s['hidden']} with a {s['vocab']:,}-token vocabulary (fp32, built in "
             f"code), LoRA r={s['r']} on every linear layer of the blocks, AdamW; rows of {s['seq']} tokens "
             f"({s['prompt']} prompt + {s['seq'] - s['prompt']} completion). DPO: 1 pair (2 rows), sigmoid, "
             "beta 0.1, adapters-off reference. ORPO, SimPO: the same pair, the tasks' defaults (ORPO's "
             "NLL scores the chosen prompt too). KTO: the pair's completions as 1 desirable + 1 undesirable "
             "example (2 rows with gradient; 2 mismatched KL rows and 4 reference rows without), beta 0.1. "
             "GRPO: 1 prompt x G = 2 injected completions "
             f"({s['seq'] - s['prompt']} and {(s['seq'] - s['prompt']) * 3 // 4} tokens), beta 0.04, "
             "dapo. RLOO: the same rows, k = 2, beta 0.04 (its loss is 0 in value: the advantages of a "
             f"prompt sum to 0). One fp32 copy of a row's logits is {_mib(res['logits_fp32_bytes_per_row'])} MiB. "
             f"Chunked: `train.loss_chunk_tokens` {s['chunk_tokens']} (its `auto` value here); "
             "unchunked: 0.", "",
             "| task | side | held MiB | step peak MiB | peak MiB | loss | step CPU s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name in TASKS:
        for side in ("chunked", "unchunked"):
            r = res[name][side]
            lines.append(f"| {name} | {side} | {_mib(r['held_bytes'])} | {_mib(r['step_peak_bytes'])} | "
                         f"{_mib(r['peak_bytes'])} | {r['loss']:.6f} | {r['step_cpu_s']:.2f} |")
    lines.append("")
    for name in TASKS:
        r = res[name]
        lines.append(f"- {name}: {100 * r['saving']:.1f} % less peak chunked (goal >= {100 * GOAL:.0f} %: "
                     f"{'held' if r['saving'] >= GOAL else 'NOT held'}); |loss chunked - unchunked| = "
                     f"{r['loss_abs_diff']:.2e}.")
    lines += ["", f"Peak = {res['definition']}", "",
              f"Versions: {ordered(res['versions'], VERSIONS)}. Total {res['wall_s']:.0f} s.", ""]
    return "\n".join(lines)


def run(out: Path, s: Sizes = Sizes(), command: str | None = None) -> dict:
    """Measure and write ``out/results.json`` and ``out/results.md``."""
    import transformers
    from transformers import logging as hf_logging

    from rankwise.memory import METERS, meter_name
    hf_logging.set_verbosity_error()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        res: dict[str, Any] = {"command": command or f"rankwise bench chunked-logprobs --out {out}",
                               "timer": "process CPU time, 1 torch thread", **measure_all(s)}
    finally:
        torch.set_num_threads(threads)
    res["meter"] = meter_name("cpu")
    res["definition"] = ("bytes of the model's tensors and the optimizer state, plus the peak one "
                         f"training step adds above them by the meter '{res['meter']}': "
                         f"{METERS[res['meter']]}.")
    res["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                       "transformers": transformers.__version__}
    res["wall_s"] = time.perf_counter() - t0
    write_results(Path(out), res, markdown(res))
    return res
