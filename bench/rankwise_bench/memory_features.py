"""Peak memory of issue 21's two exact savings, by the shared meter (:mod:`rankwise.memory`):

* **Chunked loss** (``train.loss_chunk_tokens``): an ``llm-finetune`` row (the same Llama built
  in code, LoRA r=16 on every linear layer of the blocks, AdamW, fp32; :mod:`.llm_finetune`'s
  pieces) with a 150k vocabulary at sequence 1024. Three sides step the same batches:
  rankwise chunked (512 target tokens a chunk, the ``auto`` value), rankwise unchunked
  (``loss_chunk_tokens: 0``), PEFT (``get_peft_model``) with the loss transformers computes
  from ``labels`` (``model(**batch).loss``), and PEFT with TRL's fused LM head: what TRL 1.16's
  ``SFTTrainer`` computes by default (``loss_type: nll``): ``trl.trainer.utils.add_fused_lm_head``
  on the base model before PEFT wraps it, ``model(**batch, fused_lm_head=True)``, the loss
  ``-log_probs.sum() / targets`` - per-token log-probabilities projected through
  ``lm_head.weight`` in tiles (TRL's ``_ChunkedLogProbFunction``), with the entropy and top-1
  fields ``SFTTrainer`` asks for. It runs with PEFT as long as ``lm_head`` carries no adapter
  (``SFTTrainer`` refuses one: the tiles read ``lm_head.weight`` directly).
* **Per-layer updates** (``optim.per_layer``): full fine-tuning of a small Llama with AdamW,
  ordinary step vs per-layer, against the gradient bytes (= the trainable parameters' bytes).

Peak = bytes held between steps (model, optimizer state) + the peak one step adds above them,
measured on a step after the warm-up (the optimizer state exists then). Run:
``rankwise bench memory-features --out bench/results/chunked-loss``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise_bench.common import ordered, write_results
from rankwise_bench.llm_finetune import Sizes, _windows, build_base, build_pair

CHUNK = Sizes(hidden=64, layers=2, heads=4, intermediate=176, seq=1024, batch=1, warmup=1,
              steps=1, eval_windows=1, vocab=150_000, rows=("fp32",), gora_batches=0)
PER_LAYER = (  # the same Llama, two batch shapes: activations ~ the gradients, and far below
    Sizes(hidden=512, layers=4, heads=8, intermediate=1408, seq=64, batch=2, warmup=1, steps=2,
          eval_windows=1, lr=1e-4, gora_batches=0),
    Sizes(hidden=512, layers=4, heads=8, intermediate=1408, seq=16, batch=1, warmup=1, steps=2,
          eval_windows=1, lr=1e-4, gora_batches=0),
)
CHUNK_TOKENS = 512
GOAL = 0.30  # the chunked peak is at least this fraction below the unchunked one


def _held(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    from rankwise.core.quant import model_bytes
    from rankwise.memory import tensor_bytes
    return model_bytes(model) + tensor_bytes(dict(opt.state))


def _measure(step, held: int, device: str) -> dict[str, Any]:
    from rankwise.memory import PeakMemory
    t0 = time.process_time()
    with PeakMemory(device) as mem:
        loss = step()
    return {"held_bytes": held, "step_peak_bytes": mem.peak_bytes, "peak_bytes": held + mem.peak_bytes,
            "meter": mem.meter, "loss": loss, "step_cpu_s": time.process_time() - t0}


def chunked_loss(s: Sizes = CHUNK, chunk_tokens: int = CHUNK_TOKENS) -> dict[str, Any]:
    """The three loss paths of an ``llm-finetune`` fp32 row at a large vocabulary."""
    from rankwise_bench.llm_finetune import _Side
    from rankwise.engine.loop import draw_batches
    from rankwise.engine import get_task
    data, _, info = _windows(s)
    out: dict[str, Any] = {"sizes": dataclasses.asdict(s), "chunk_tokens": chunk_tokens, "corpus": info}
    with tempfile.TemporaryDirectory() as tmp:
        out["params"] = build_base(s, Path(tmp))
        ours, theirs, _ = build_pair(Path(tmp), "fp32", s)
        models = {"rankwise chunked": ours, "rankwise unchunked": copy.deepcopy(ours)}  # same start
        for name, chunk in (("rankwise chunked", chunk_tokens), ("rankwise unchunked", 0)):
            side = _Side(models[name], data, dataclasses.replace(s, loss_chunk_tokens=chunk), "fp32")
            for k in range(s.warmup):
                side.step(k, timed=False)
            out[name] = _measure(lambda: side.engine.train_step(s.warmup).loss,
                                 _held(models[name], side.opt), s.device)
            del side
        opt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=s.lr)
        task = get_task("causal-lm")

        def hf_step(k: int) -> float:
            batch = draw_batches(data, task, k, s.batch, s.seed, s.device)[0]
            loss = theirs(**batch).loss                      # transformers' own causal-LM loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        for k in range(s.warmup):
            hf_step(k)
        out["peft + transformers loss"] = _measure(lambda: hf_step(s.warmup), _held(theirs, opt), s.device)
        del theirs, opt
        trl = _trl_side(s, data, Path(tmp))
        if trl is not None:
            out["peft + trl fused head"] = trl
    out["trl_version"] = _trl_version()
    unchunked = out["rankwise unchunked"]["peak_bytes"]
    out["saving_vs_unchunked"] = 1 - out["rankwise chunked"]["peak_bytes"] / unchunked
    out["saving_vs_peft"] = 1 - out["rankwise chunked"]["peak_bytes"] / out["peft + transformers loss"]["peak_bytes"]
    if "peft + trl fused head" in out:
        trl_peak = out["peft + trl fused head"]["peak_bytes"]
        out["trl_saving_vs_unchunked"] = 1 - trl_peak / unchunked
        out["saving_vs_trl"] = 1 - out["rankwise chunked"]["peak_bytes"] / trl_peak
    out["loss_abs_diff"] = abs(out["rankwise chunked"]["loss"] - out["rankwise unchunked"]["loss"])
    out["logits_fp32_bytes"] = s.batch * (s.seq - 1) * s.vocab * 4
    return out


def _trl_version() -> str | None:
    try:
        import trl
    except ImportError:
        return None
    return trl.__version__


def _trl_side(s: Sizes, data, folder: Path) -> dict[str, Any] | None:
    """PEFT (the row's LoRA) with TRL's fused LM head, stepped as ``SFTTrainer.compute_loss``
    steps it by default; ``None`` when TRL is not installed."""
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:
        return None
    from rankwise.engine import get_task
    from rankwise.engine.loop import draw_batches
    _, model, _ = build_pair(folder, "fp32", s)           # a fresh PEFT model from the same base
    add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=s.lr)
    task = get_task("causal-lm")

    def step(k: int) -> float:
        batch = draw_batches(data, task, k, s.batch, s.seed, s.device)[0]
        out = model(**batch, fused_lm_head=True)
        loss = -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)  # SFTTrainer's nll
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    for k in range(s.warmup):
        step(k)
    return _measure(lambda: step(s.warmup), _held(model, opt), s.device)


def per_layer(s: Sizes = PER_LAYER) -> dict[str, Any]:
    """Full fine-tuning with AdamW: the ordinary step vs per-layer updates."""
    from transformers import AutoModelForCausalLM

    from rankwise.engine import Engine, get_task
    data, _, _ = _windows(s)
    out: dict[str, Any] = {"sizes": dataclasses.asdict(s)}
    with tempfile.TemporaryDirectory() as tmp:
        out["params"] = build_base(s, Path(tmp))
        for name, flag in (("ordinary step", False), ("per_layer", True)):
            model = AutoModelForCausalLM.from_pretrained(tmp).train()
            opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.1)
            eng = Engine(model, get_task("causal-lm"), opt, data, s.batch, seed=s.seed, per_layer=flag)
            losses = [eng.train_step(k).loss for k in range(s.warmup + s.steps - 1)]
            if not flag:  # what the forward alone keeps for the backward (the loss graph)
                out["forward_peak_bytes"] = _measure(
                    lambda: float(eng.task.loss_sum(model, eng.step_batches(0)[0])[0].detach()), 0, s.device
                )["step_peak_bytes"]
            out[name] = _measure(lambda: eng.train_step(s.warmup + s.steps - 1).loss,
                                 _held(model, opt), s.device)
            out[name]["losses"] = losses + [out[name]["loss"]]
            out["gradient_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
            del model, opt, eng
    a, b = out["ordinary step"]["peak_bytes"], out["per_layer"]["peak_bytes"]
    out["drop_bytes"] = a - b
    out["drop_over_gradient_bytes"] = (a - b) / out["gradient_bytes"]
    out["max_loss_diff"] = max(abs(x - y) for x, y in zip(out["ordinary step"]["losses"],
                                                           out["per_layer"]["losses"]))
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _trl_line(c: dict) -> str:
    if "peft + trl fused head" not in c:
        return "TRL is not installed here: no TRL side."
    return (f"PEFT + TRL {c['trl_version']}'s fused LM head (SFTTrainer's default `nll` loss, tiles of "
            f"the vocabulary, LoRA on the blocks only: SFTTrainer refuses a LoRA on `lm_head`): "
            f"{100 * c['trl_saving_vs_unchunked']:.1f} % less peak than rankwise unchunked; rankwise "
            f"chunked is {100 * c['saving_vs_trl']:.1f} % below it.")


VERSIONS = ("python", "torch", "transformers", "peft", "trl")  # run()'s order


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    c, p = res["chunked_loss"], res["per_layer"][0]
    cs, ps = c["sizes"], p["sizes"]
    lines = ["# Memory features (issue 21): chunked loss, per-layer updates", "",
             f"Command: `{res['command']}` ({res['timer']}; meter `{res['meter']}`).", "",
             "## Chunked loss", "",
             f"`llm-finetune` fp32 row: Llama {cs['layers']}x{cs['hidden']} with a {cs['vocab']:,}-token "
             f"vocabulary ({c['params'] / 1e6:.1f}M parameters, nearly all in the embeddings and the "
             f"head), LoRA r={cs['r']} on every linear layer of the blocks, AdamW, batch {cs['batch']} "
             f"x {cs['seq']} tokens; one fp32 copy of the logits is {_mib(c['logits_fp32_bytes'])} MiB.", "",
             "| side | held MiB | step peak MiB | peak MiB | loss | step CPU s |", "|---|---:|---:|---:|---:|---:|"]
    for name in ("rankwise chunked", "rankwise unchunked", "peft + transformers loss", "peft + trl fused head"):
        if name not in c:
            continue
        r = c[name]
        lines.append(f"| {name} | {_mib(r['held_bytes'])} | {_mib(r['step_peak_bytes'])} | "
                     f"{_mib(r['peak_bytes'])} | {r['loss']:.5f} | {r['step_cpu_s']:.2f} |")
    lines += ["", f"Chunked ({c['chunk_tokens']} target tokens a chunk) vs unchunked: "
              f"{100 * c['saving_vs_unchunked']:.1f} % less peak (goal >= {100 * GOAL:.0f} %: "
              f"{'held' if c['saving_vs_unchunked'] >= GOAL else 'NOT held'}); vs PEFT + transformers' "
              f"loss: {100 * c['saving_vs_peft']:.1f} % less. |loss chunked - unchunked| = "
              f"{c['loss_abs_diff']:.2e}.", "", _trl_line(c), "",
             "## Per-layer updates", "",
             f"Full fine-tuning of a Llama {ps['layers']}x{ps['hidden']} (intermediate "
             f"{ps['intermediate']}, {p['params'] / 1e6:.1f}M parameters), AdamW (weight decay 0.1); "
             f"gradients {_mib(p['gradient_bytes'])} MiB (= the fp32 weights).", "",
             "| batch x seq | forward alone MiB | step peak MiB: ordinary / per_layer | peak MiB: "
             "ordinary / per_layer | drop MiB | drop / gradient bytes | max loss diff |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["per_layer"]:
        a, b = r["ordinary step"], r["per_layer"]
        lines.append(f"| {r['sizes']['batch']} x {r['sizes']['seq']} | {_mib(r['forward_peak_bytes'])} | "
                     f"{_mib(a['step_peak_bytes'])} / {_mib(b['step_peak_bytes'])} | {_mib(a['peak_bytes'])} / "
                     f"{_mib(b['peak_bytes'])} | {_mib(r['drop_bytes'])} | {r['drop_over_gradient_bytes']:.2f} | "
                     f"{r['max_loss_diff']:.1e} |")
    lines += ["", "Held between steps (both): weights + AdamW's two moments = "
              f"{_mib(p['per_layer']['held_bytes'])} MiB. The ordinary step peaks at the end of the "
              "backward (every gradient alive); per-layer updates hold one gradient at a time, so "
              "their peak is the forward's saved activations (plus one gradient): the drop is the "
              "gradient bytes less what the activations add back.", "",
              f"Peak = {res['definition']}", "",
              f"Versions: {ordered(res['versions'], VERSIONS)}. Total {res['wall_s']:.0f} s.", ""]
    return "\n".join(lines)


def run(out: Path, command: str | None = None) -> dict:
    """Measure both features and write ``out/results.json`` and ``out/results.md``."""
    import peft
    import transformers
    from transformers import logging as hf_logging

    from rankwise.memory import METERS, meter_name
    hf_logging.set_verbosity_error()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        res: dict[str, Any] = {"command": command or f"rankwise bench memory-features --out {out}",
                               "timer": "process CPU time, 1 torch thread",
                               "chunked_loss": chunked_loss(copy.deepcopy(CHUNK)),
                               "per_layer": [per_layer(copy.deepcopy(s)) for s in PER_LAYER]}
    finally:
        torch.set_num_threads(threads)
    res["meter"] = meter_name("cpu")
    res["definition"] = ("bytes of the model's tensors and the optimizer state, plus the peak one "
                         f"training step adds above them by the meter '{res['meter']}': "
                         f"{METERS[res['meter']]}.")
    res["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                       "transformers": transformers.__version__, "peft": peft.__version__,
                       "trl": _trl_version()}
    res["wall_s"] = time.perf_counter() - t0
    write_results(Path(out), res, markdown(res))
    return res


def main(argv: list[str] | None = None) -> dict:
    """``rankwise bench memory-features --out DIR``."""
    parser = argparse.ArgumentParser(prog="rankwise bench memory-features", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return run(args.out, command=f"rankwise bench memory-features --out {args.out}")


if __name__ == "__main__":  # pragma: no cover
    main()
