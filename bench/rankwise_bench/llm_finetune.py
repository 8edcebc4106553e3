"""``rankwise bench llm-finetune``: LoRA fine-tuning of a Llama at real-scale settings (bf16,
QLoRA on an NF4 base, activation checkpointing), rankwise against transformers + PEFT.

Setup: a Llama built in code (random init, seeded; byte vocabulary, so its parameters sit in the
blocks), saved once to a temporary folder so that every model of the benchmark is loaded from the
same weights by ``from_pretrained`` - in the row's dtype, or quantized on load by the row's
``BitsAndBytesConfig``. Data: windows of the Python standard library's source as bytes
(:func:`rankwise_bench.corpus.load_corpus`). LoRA r=16 on every linear layer of the
blocks, AdamW.

Each row builds a rankwise model and a PEFT model as their users would:

* rankwise: ``model.dtype`` / ``model.quantize`` / ``train.precision`` /
  ``train.gradient_checkpointing`` exactly as ``rankwise train`` applies them
  (:func:`rankwise.recipes.model.enable_checkpointing`: non-reentrant, no input-grad hook;
  norms and embeddings stay in ``model.dtype``);
* PEFT: ``get_peft_model`` with ``target_modules="all-linear"``; on a 4-bit base after
  ``prepare_model_for_kbit_training`` (its default upcasts every non-4-bit tensor to fp32 and,
  with checkpointing, uses reentrant checkpointing plus ``enable_input_require_grads``); on a
  bf16 base with checkpointing, ``gradient_checkpointing_enable()`` (transformers' default).

PEFT's LoRA factors are copied from rankwise's, and both models are stepped by the same engine
step (:meth:`rankwise.engine.Engine.train_step`) on the same batches, interleaved step by step
(the order flips every step). Measures per side: median step time (CPU: process time with one
torch thread; CUDA: synchronised wall time), tokens/s, peak memory = bytes of the model and
optimizer state + the peak one step adds above them (:mod:`rankwise.memory`'s meter), base
weight bytes (quantization state included), train loss at the last step and held-out loss.

DoRA rows (``dora-<row>``, Liu et al. 2024): the same row with ``use_dora`` on both sides - rankwise's
``method: {name: lora, use_dora: true}`` against PEFT's ``LoraConfig(use_dora=True)``, magnitudes
copied too. They are not in the default rows; ``rankwise bench llm-finetune-dora`` (preset
``cpu-dora``, a smaller model so that the five rows fit in about six minutes of one core) runs them.

Fused rows (``--set fused=true``; ``rankwise bench llm-finetune-fused``, preset ``cpu-fused``): a
third model per row, rankwise with ``train.fused_lora: auto`` (:mod:`rankwise.adapters.lora.fused`),
same base, same LoRA init, stepped interleaved with the other two; the ``rankwise`` side then runs
the plain path (``fused_lora`` off), so the columns compare fused, plain and PEFT in one process.

Compiled rows (``--set compiled=true``, with ``fused=true``; on in preset ``gpu-1b``): one more
model per row, the fused side with its blocks compiled as ``train.compile: true`` compiles them
(:func:`rankwise.engine.compile.compile_model`); its first warm-up step compiles (recorded as
``compile_s``, not timed). The windows have one length, so one graph per block kind is built.
Every row also records ``best_path`` (the fastest of plain, fused and compiled) and its ratios
to PEFT: issue 39's target is the best path's step <= 0.8x and peak <= 0.85x PEFT's.

Liger peer (``--set liger=true``, CUDA only; ``bench/gpu/llm-finetune.sh`` adds it when the
``liger_kernel`` package imports): a fourth model per row, PEFT on a base whose RMSNorm and SwiGLU
MLP modules are Liger's Triton kernels (``apply_liger_kernel_to_llama(model=...)``, instance
patches). Liger's RoPE is a module-global replacement (it would change the other sides too) and
its fused linear cross-entropy engages only when the model gets ``labels`` (the shared engine
step computes every side's loss from the logits), so both stay off. liger-kernel has no CPU path
(every kernel is Triton; its backends are CUDA/ROCm, XPU, Ascend), so it is not a dependency.

Run at other sizes with ``rankwise bench llm-finetune --preset gpu-1b`` (what
``bench/gpu/llm-finetune.sh`` runs) or ``--set hidden=256 --set layers=4``.
"""
from __future__ import annotations

import copy
import dataclasses
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise_bench.common import llama, write_results
from rankwise_bench.llm_finetune_report import DORA, TARGETS, markdown

ROWS = {  # name -> (model.dtype, model.quantize, train.precision, gradient checkpointing)
    "fp32": ("float32", None, "fp32", False),
    "bf16": ("bfloat16", None, "bf16", False),
    "bf16+ckpt": ("bfloat16", None, "bf16", True),
    "nf4": ("bfloat16", "nf4", "bf16", False),
    "nf4+ckpt": ("bfloat16", "nf4", "bf16", True),
}


@dataclass
class Sizes:
    """Everything that sets the benchmark's size (default: the CPU run, ~20 min on 2 cores).

    Attributes:
        hidden, layers, heads, intermediate: The Llama shape (full multi-head attention).
        seq: Bytes per window.
        batch: Windows per optimizer step.
        warmup: Untimed steps per model first.
        steps: Timed steps per model.
        eval_windows: Held-out windows for the final loss.
        r, alpha, lr: LoRA rank and alpha, AdamW learning rate.
        rows: Rows to run (keys of :data:`ROWS`).
        gora_batches: Calibration batches of the GoRA gradient-phase memory check on the bf16
            and NF4 bases (0 = skip it).
        device: ``cpu`` or ``cuda``.
        threads: torch threads on CPU.
        seed: Seed of the weights and of the batch order.
        fused: Add the ``fused`` side (rankwise with the fused LoRA path) to every row.
        liger: Add the ``liger`` side (PEFT on Liger's RMSNorm/SwiGLU kernels; CUDA only).
        compiled: Add the ``compiled`` side: the fused side with its blocks compiled
            (``train.compile``, :func:`rankwise.engine.compile.compile_model`); its first warm-up
            step, which compiles, is recorded apart as ``compile_s``.
        compile_backend: ``torch.compile``'s backend of that side (tests: ``aot_eager``).
        vocab: Vocabulary of the model (the data are bytes, ids < 256; a larger vocabulary only
            widens the embeddings, the head and the logits: the chunked-loss measurement).
        loss_chunk_tokens: ``train.loss_chunk_tokens`` of the engine step both sides use (0:
            unchunked; :mod:`rankwise_bench.memory_features` compares the loss paths).
    """

    hidden: int = 512
    layers: int = 9
    heads: int = 8
    intermediate: int = 1408
    seq: int = 256
    batch: int = 8
    warmup: int = 1
    steps: int = 5
    eval_windows: int = 16
    r: int = 16
    alpha: float = 32.0
    lr: float = 2e-3
    rows: tuple[str, ...] = tuple(ROWS)
    gora_batches: int = 2
    device: str = "cpu"
    threads: int = 1
    seed: int = 0
    fused: bool = False
    vocab: int = 256
    liger: bool = False
    loss_chunk_tokens: int = 0
    compiled: bool = False
    compile_backend: str = "inductor"


PRESETS = {
    "cpu": Sizes(),
    "gpu-1b": Sizes(hidden=2048, layers=16, heads=16, intermediate=8192, seq=1024, batch=8,
                    warmup=2, steps=10, eval_windows=32, device="cuda",
                    rows=("bf16", "bf16+ckpt", "nf4", "nf4+ckpt"), fused=True, compiled=True),
    "tiny": Sizes(hidden=64, layers=2, heads=4, intermediate=128, seq=32, batch=4, warmup=1,
                  steps=2, eval_windows=4),
    "cpu-dora": Sizes(hidden=256, layers=4, heads=4, intermediate=704, seq=128, batch=8, warmup=1,
                      steps=5, eval_windows=8, gora_batches=0,
                      rows=tuple(DORA + row for row in ROWS)),
    "cpu-fused": Sizes(hidden=256, layers=4, heads=4, intermediate=704, seq=256, batch=4,
                       warmup=1, steps=8, eval_windows=4, gora_batches=0, fused=True),
}


def base_row(row: str) -> str:
    """The precision row of ``row`` (``dora-nf4`` -> ``nf4``)."""
    return row.removeprefix(DORA)


def build_base(s: Sizes, folder: Path) -> int:
    """Write the benchmark's Llama (seeded random weights, float32) to ``folder``; return its
    parameter count."""
    model = llama(s.vocab, s.hidden, s.layers, s.heads, s.intermediate, positions=s.seq, seed=s.seed,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False, use_cache=False)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def load_base(folder: Path, row: str, device: str) -> nn.Module:
    """The row's base model from ``folder``: in its dtype, or quantized on load (bitsandbytes)."""
    from transformers import AutoModelForCausalLM

    from rankwise.recipes.model import bnb_config, dtype_kwargs, torch_dtype
    dtype, quantize, _, _ = ROWS[base_row(row)]
    kwargs = dtype_kwargs(torch_dtype(dtype))
    if quantize:
        kwargs.update(quantization_config=bnb_config(quantize, dtype), device_map={"": device})
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    return model.to(device) if not quantize else model


def build_ours(folder: Path, row: str, s: Sizes, fused: bool) -> tuple[nn.Module, int]:
    """``(rankwise model, base weight bytes)`` of ``row``, with ``train.fused_lora`` ``auto``
    (``fused``) or off."""
    from rankwise.adapters.lora import LoraConfig, apply_lora
    from rankwise.core.quant import model_bytes
    from rankwise.recipes.model import enable_checkpointing
    from rankwise.recipes.session import set_fused_lora
    ours = load_base(folder, row, s.device)
    base_bytes = model_bytes(ours)
    torch.manual_seed(s.seed + 1)
    apply_lora(ours, LoraConfig(r=s.r, alpha=s.alpha, targets="all-linear",
                                use_dora=row.startswith(DORA)))
    if ROWS[base_row(row)][3]:
        enable_checkpointing(ours)
    set_fused_lora(ours, "auto" if fused else "off")
    return ours.train(), base_bytes


def build_pair(folder: Path, row: str, s: Sizes) -> tuple[nn.Module, nn.Module, int]:
    """``(rankwise model, PEFT model, base weight bytes)`` of ``row``, same base, same LoRA init
    (and the same DoRA magnitudes on a ``dora-`` row)."""
    ours, base_bytes = build_ours(folder, row, s, fused=False)
    theirs = peft_side(folder, row, s, ours)
    return ours.train(), theirs.train(), base_bytes


def peft_side(folder: Path, row: str, s: Sizes, ours: nn.Module, liger: bool = False) -> nn.Module:
    """transformers + PEFT of ``row`` with ``ours``'s LoRA factors; ``liger``: on a base whose
    RMSNorm and SwiGLU MLP modules are Liger's kernels (this instance only)."""
    import peft

    from rankwise.core.ops import adapter_parameters
    _, quantize, _, ckpt = ROWS[base_row(row)]
    use_dora = row.startswith(DORA)
    theirs = load_base(folder, row, s.device)
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from transformers.models.llama import modeling_llama
        kept = (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)
        apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=False,
                                    rms_norm=True, swiglu=True, model=theirs)
        modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP = kept  # the next models stay plain
    if quantize:
        theirs = peft.prepare_model_for_kbit_training(theirs, use_gradient_checkpointing=ckpt)
    elif ckpt:
        theirs.gradient_checkpointing_enable()
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(
        r=s.r, lora_alpha=s.alpha, target_modules="all-linear", lora_dropout=0.0,
        task_type="CAUSAL_LM", use_dora=use_dora))
    dst = dict(theirs.named_parameters())
    with torch.no_grad():
        for key, p in adapter_parameters(ours).items():
            path, kind = key.split(".lora_")           # A.weight, B.weight, magnitude_vector
            kind = "magnitude_vector" if kind == "magnitude_vector" else kind[0]
            dst[f"base_model.model.{path}.lora_{kind}.default.weight"].copy_(p)
    n_ours = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    n_theirs = sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    assert n_ours == n_theirs, (row, n_ours, n_theirs)
    return theirs


def _windows(s: Sizes):
    from rankwise_bench.corpus import ByteWindows, load_corpus
    train, heldout, info = load_corpus()
    g = torch.Generator().manual_seed(s.seed)
    n = s.batch * (s.warmup + s.steps + 1)
    starts = torch.randint(0, len(train) - s.seq, (n,), generator=g)
    held = torch.randint(0, len(heldout) - s.seq, (s.eval_windows,), generator=g)
    return ByteWindows(train, starts, s.seq), ByteWindows(heldout, held, s.seq), info


class _Side:
    """One model of a row with its optimizer and engine, and what it measured."""

    def __init__(self, model: nn.Module, data, s: Sizes, precision: str) -> None:
        from rankwise.engine import Engine, get_task
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=s.lr)
        task = get_task("causal-lm")
        task.loss_chunk_tokens = s.loss_chunk_tokens
        self.engine = Engine(model, task, self.opt, data, s.batch, seed=s.seed,
                             precision=precision, device=s.device)
        self.times: list[float] = []
        self.losses: list[float] = []
        self.cuda = s.device.startswith("cuda")
        self.first_s = float("nan")  # the first step's time (the compiled side compiles in it)

    def step(self, k: int, timed: bool) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        result = self.engine.train_step(k)
        if self.cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0 if self.cuda else time.process_time() - c0
        self.losses.append(result.loss)
        if k == 0:
            self.first_s = dt
        if timed:
            self.times.append(dt)

    def peak_bytes(self, k: int) -> tuple[int, int, str]:
        """``(held bytes, step peak above them, meter)`` of one more step."""
        from rankwise.core.quant import model_bytes
        from rankwise.memory import PeakMemory, tensor_bytes
        held = model_bytes(self.model) + tensor_bytes(dict(self.opt.state))
        with PeakMemory(self.engine.device) as mem:
            self.engine.train_step(k)
        return held, mem.peak_bytes, mem.meter


def _peft_setup(row: str) -> str:
    """What the PEFT side of ``row`` did (recorded in the results)."""
    _, quantize, _, ckpt = ROWS[base_row(row)]
    if row.startswith(DORA):
        return _peft_setup(base_row(row)).replace("get_peft_model", "get_peft_model(use_dora=True)")
    if quantize:
        return ("prepare_model_for_kbit_training(use_gradient_checkpointing=%s)%s, get_peft_model"
                % (ckpt, ": reentrant checkpointing + enable_input_require_grads" if ckpt else ""))
    if ckpt:
        return ("gradient_checkpointing_enable() (transformers' default: non-reentrant), "
                "get_peft_model (adds enable_input_require_grads)")
    return "get_peft_model"


def run_row(folder: Path, row: str, s: Sizes, data, heldout) -> dict:
    """Build both sides of ``row``, step them interleaved, and measure."""
    from rankwise.engine import evaluate, get_task
    ours, theirs, base_bytes = build_pair(folder, row, s)
    precision = ROWS[base_row(row)][2]
    sides = {"rankwise": _Side(ours, data, s, precision), "peft": _Side(theirs, data, s, precision)}
    if s.fused:
        sides["fused"] = _Side(build_ours(folder, row, s, fused=True)[0], data, s, precision)
    if s.liger:
        sides["liger"] = _Side(peft_side(folder, row, s, ours, liger=True).train(), data, s, precision)
    if s.compiled:
        from rankwise.engine.compile import compile_model
        model = build_ours(folder, row, s, fused=True)[0]
        compile_model(model, backend=s.compile_backend)
        sides["compiled"] = _Side(model, data, s, precision)
    for k in range(s.warmup + s.steps):
        order = list(sides) if k % 2 == 0 else list(sides)[::-1]
        for name in order:
            sides[name].step(k, timed=k >= s.warmup)
    out: dict[str, Any] = {"base_weight_bytes": base_bytes}
    task = get_task("causal-lm")
    for name, side in sides.items():
        held, peak, meter = side.peak_bytes(s.warmup + s.steps)
        ev = evaluate(side.model, task, heldout, s.batch, s.device, side.engine.autocast)
        med = statistics.median(side.times)
        out[name] = {"step_s": med, "step_s_all": side.times, "tokens_per_s": s.batch * s.seq / med,
                     "held_bytes": held, "step_peak_bytes": peak, "peak_bytes": held + peak,
                     "memory_meter": meter, "loss_last_step": side.losses[s.warmup + s.steps - 1],
                     "losses": side.losses, "eval_loss": ev["eval_loss"]}
    out["step_time_ratio"] = out["rankwise"]["step_s"] / out["peft"]["step_s"]
    out["step_time_ratio_min"] = min(sides["rankwise"].times) / min(sides["peft"].times)
    out["peft_setup"] = _peft_setup(row)
    out["memory_ratio"] = out["rankwise"]["peak_bytes"] / out["peft"]["peak_bytes"]
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(sides["rankwise"].losses, sides["peft"].losses))
    if "fused" in sides:
        f, p, r = out["fused"], out["peft"], out["rankwise"]
        out["fused_step_time_ratio"] = f["step_s"] / p["step_s"]
        out["fused_step_time_ratio_min"] = min(sides["fused"].times) / min(sides["peft"].times)
        out["fused_memory_ratio"] = f["peak_bytes"] / p["peak_bytes"]
        out["fused_vs_plain_step"] = f["step_s"] / r["step_s"]
        out["fused_vs_plain_memory"] = f["peak_bytes"] / r["peak_bytes"]
        out["fused_vs_plain_max_loss_diff"] = max(
            abs(a - b) for a, b in zip(sides["fused"].losses, sides["rankwise"].losses))
    if "compiled" in sides:
        out.update(_compiled_ratios(sides, out))
    paths = [name for name in ("rankwise", "fused", "compiled") if name in sides]
    out["best_path"] = min(paths, key=lambda name: out[name]["step_s"])
    out["best_step_time_ratio"] = out[out["best_path"]]["step_s"] / out["peft"]["step_s"]
    out["best_memory_ratio"] = min(out[name]["peak_bytes"] for name in paths) / out["peft"]["peak_bytes"]
    if "liger" in sides:
        g, p = out["liger"], out["peft"]
        out["liger_step_time_ratio"] = g["step_s"] / p["step_s"]
        out["liger_memory_ratio"] = g["peak_bytes"] / p["peak_bytes"]
        out["liger_max_loss_diff"] = max(
            abs(a - b) for a, b in zip(sides["liger"].losses, sides["peft"].losses))
        if "fused" in sides:
            out["fused_vs_liger_step"] = out["fused"]["step_s"] / g["step_s"]
            out["fused_vs_liger_memory"] = out["fused"]["peak_bytes"] / g["peak_bytes"]
    if row == "nf4" and not s.fused:
        from rankwise_bench.qlora_checks import requantize_drift
        with tempfile.TemporaryDirectory() as tmp:
            out["requantize"] = requantize_drift(ours, s, heldout, Path(tmp))
    del sides, ours, theirs
    return out


def _compiled_ratios(sides: dict[str, _Side], out: dict) -> dict[str, float]:
    """The compiled side against PEFT and against the eager fused side (same weights, same
    batches): step time, memory, loss difference, and the compiling step's time."""
    c, p, f = out["compiled"], out["peft"], out["fused"]
    c["compile_s"] = sides["compiled"].first_s
    return {"compiled_step_time_ratio": c["step_s"] / p["step_s"],
            "compiled_memory_ratio": c["peak_bytes"] / p["peak_bytes"],
            "compiled_vs_fused_step": c["step_s"] / f["step_s"],
            "compiled_vs_fused_max_loss_diff": max(
                abs(a - b) for a, b in zip(sides["compiled"].losses, sides["fused"].losses))}


def _versions() -> dict[str, str]:
    import bitsandbytes
    import peft
    import transformers
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "peft": peft.__version__,
           "bitsandbytes": bitsandbytes.__version__, "machine": platform.machine()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def run(out: Path, sizes: Sizes | None = None, command: str | None = None) -> dict:
    """Run the benchmark and write ``out/results.json`` and ``out/results.md``.

    Args:
        out: Output folder (created if missing).
        sizes: The size (default :data:`PRESETS` ``["cpu"]``).
        command: The command line recorded in the results.

    Returns:
        The results dict.

    Raises:
        RankwiseError: If peft or bitsandbytes is missing (names the pip extra), or the rows
            name an unknown row, or CUDA is asked for and absent.
    """
    from rankwise.errors import RankwiseError, require
    require("peft", "bench", "rankwise bench llm-finetune")
    require("bitsandbytes", "bench", "rankwise bench llm-finetune")
    s = copy.deepcopy(sizes or PRESETS["cpu"])
    unknown = [r for r in s.rows if base_row(r) not in ROWS]
    if unknown:
        raise RankwiseError(f"llm-finetune rows {unknown} are unknown; choose from {list(ROWS)}, "
                            f"each also as {DORA}<row>")
    if s.liger:
        import importlib.util
        if not s.device.startswith("cuda") or importlib.util.find_spec("liger_kernel") is None:
            raise RankwiseError("llm-finetune: liger=true needs a CUDA device and the liger-kernel "
                                "package (Triton kernels, no CPU path); drop --set liger=true")
    if s.compiled and (not s.fused or s.warmup < 1):
        raise RankwiseError("llm-finetune: compiled=true compiles the fused side in its first "
                            "warm-up step; set fused=true and warmup >= 1")
    if s.device.startswith("cuda") and not torch.cuda.is_available():
        raise RankwiseError("llm-finetune: device cuda asked for but no CUDA GPU is visible; "
                            "run on a GPU machine or use --preset cpu")
    from transformers import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    threads = torch.get_num_threads()
    if not s.device.startswith("cuda"):
        torch.set_num_threads(s.threads)
    t_start = time.perf_counter()
    try:
        data, heldout, info = _windows(s)
        res: dict[str, Any] = {"command": command or f"rankwise bench llm-finetune --out {out}",
                               "sizes": dataclasses.asdict(s), "device": s.device, "rows": {},
                               "corpus": info, "targets": TARGETS,
                               "timer": ("synchronised wall time" if s.device.startswith("cuda")
                                         else f"process CPU time, {s.threads} torch thread(s)")}
        with tempfile.TemporaryDirectory() as tmp:
            res["params"] = build_base(s, Path(tmp))
            for row in s.rows:
                res["rows"][row] = run_row(Path(tmp), row, s, data, heldout)
                if s.device.startswith("cuda"):
                    torch.cuda.empty_cache()
            if s.gora_batches:
                from rankwise_bench.qlora_checks import gora_phase_memory
                res["gora_gradient_phase"] = gora_phase_memory(Path(tmp), s, data)
    finally:
        torch.set_num_threads(threads)
    from rankwise.memory import METERS, meter_name
    rows = res["rows"]
    res["nf4_base_bytes_ratio"] = (rows["nf4"]["base_weight_bytes"] / rows["bf16"]["base_weight_bytes"]
                                   if "nf4" in rows and "bf16" in rows else None)
    res["memory_meter"] = meter_name(s.device)
    res["memory_definition"] = ("bytes of the model's tensors (quantization state included) and "
                                "the optimizer state, plus the peak one training step adds above "
                                f"them by the meter '{res['memory_meter']}': "
                                f"{METERS[res['memory_meter']]}.")
    res["versions"] = _versions()
    res["wall_s"] = time.perf_counter() - t_start
    write_results(Path(out), res, markdown(res))
    return res


def run_dora(out: Path) -> dict:
    """``rankwise bench llm-finetune-dora``: the DoRA rows only, at preset ``cpu-dora``.

    Args:
        out: Output folder (``results.json`` and ``results.md``).

    Returns:
        The results dict.
    """
    return run(out, PRESETS["cpu-dora"], command=f"rankwise bench llm-finetune-dora --out {out}")


def run_fused(out: Path) -> dict:
    """``rankwise bench llm-finetune-fused``: the five rows with the fused side, preset
    ``cpu-fused``.

    Args:
        out: Output folder (``results.json`` and ``results.md``).

    Returns:
        The results dict.
    """
    return run(out, PRESETS["cpu-fused"], command=f"rankwise bench llm-finetune-fused --out {out}")


def main(argv: list[str] | None = None) -> dict:
    """``rankwise bench llm-finetune --out DIR [--preset P] [--set k=v ...]``."""
    from rankwise_bench.common import preset_main
    return preset_main(argv, name="llm-finetune", doc=__doc__, presets=PRESETS,
                       default="cpu", run=run)


if __name__ == "__main__":  # pragma: no cover
    main()
