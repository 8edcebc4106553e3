"""``rankwise bench compress``: every compressor on two real models built here, in one process.

1. **MiniLM classifier**: the demo's LoRA run (``demo.yaml``'s ``lora``: all-MiniLM-L6-v2, LoRA
   r=8 on every linear layer, 90 steps x 32 stdlib docstrings), merged; quality = accuracy on
   its held-out docstrings; calibration = windows of its training docstrings.
2. **Small Llama on stdlib source**: the low-rank pretraining benchmark's model
   (:func:`rankwise_bench.lowrank_pretrain.build_model`, byte tokens) trained here with
   AdamW on :func:`~rankwise_bench.corpus.load_corpus`'s training modules;
   quality = perplexity per byte on its held-out modules; calibration = training windows.
   Its weights are built by the benchmark and deleted afterwards, never committed.

Decision (issue 35 item 2): compressing a model only means something for a trained one, so
row 2 should load the reference base (and its tokenizer: perplexity per byte over its pieces)
instead of training ``lowrank-pretrain``'s byte-level model; not converted yet (the rows and the
KV-cache budgets must be rerun at the base's 8,192-token vocabulary, over the time the session
that converted the others had). ``lowrank-pretrain`` itself keeps pretraining: that is its point.

Rows: the dense reference; magnitude, Wanda, SparseGPT and 3BASiL-TM at 50% unstructured and
2:4 (3BASiL adds a rank-r part, and also runs without TM at 2:4); Wanda and SparseGPT at the
unstructured sparsity that gives them 3BASiL's total parameter budget (nonzeros + factors);
SVD (plain and whitened) at 50% of the parameters; RTN, GPTQ and GLVQ at 4 and 3 bits. On the
Llama also the KV caches: float, NSNQuant and KIVI at 1 and 2 bits, and KIVI at each NSNQuant
row's stored bits per element (equal total bytes, :func:`~rankwise.compress.kv.kivi_for_budget`).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import platform
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.engine import Engine, evaluate, get_task
from rankwise.recipes.compress import Windows, measure, token_windows
from rankwise_bench.common import write_results


@dataclass
class Sizes:
    """Everything that sets the benchmark's size (default: about 30 min on 2 shared CPU cores).

    Attributes:
        models: Which models to run (``minilm``, ``llama``).
        llama_hidden, llama_layers, llama_heads, llama_intermediate: The Llama's shape.
        llama_seq: Bytes per window (training, calibration, held-out).
        llama_batch: Windows per training step.
        llama_steps: Training steps.
        llama_lr: AdamW peak learning rate (5% warm-up, cosine to 10%).
        calib_windows: Calibration windows (both models).
        heldout_windows: Held-out windows of the Llama.
        minilm_steps: Demo training steps (``None``: the demo's 90).
        minilm_calib_length: Tokens per MiniLM calibration window.
        rank: Rank of 3BASiL's low-rank part.
        overrides: Extra config keys per compressor (tests make them cheap).
        kv_chunk: Tokens per quantized KV chunk.
        kv_batch: Windows per KV-cache evaluation forward.
        threads: torch intra-op threads.
        seed: Seeds the Llama's weights, windows and batch order.
        keep_models: Keep the trained models in ``out/_work`` (default: delete them).
    """

    models: tuple[str, ...] = ("minilm", "llama")
    llama_hidden: int = 128
    llama_layers: int = 2
    llama_heads: int = 4
    llama_intermediate: int = 256
    llama_seq: int = 128
    llama_batch: int = 16
    llama_steps: int = 1500
    llama_lr: float = 3e-3
    calib_windows: int = 64
    heldout_windows: int = 64
    minilm_steps: int | None = None
    minilm_calib_length: int = 64
    rank: int = 8
    overrides: dict = dataclasses.field(default_factory=dict)
    kv_chunk: int = 16
    kv_batch: int = 32
    threads: int = 1
    seed: int = 0
    keep_models: bool = False


def budget_sparsity(shapes: list[tuple[int, int]], sparsity: float, rank: int) -> float:
    """The unstructured sparsity whose nonzeros equal ``sparsity``'s plus rank-``rank`` factors
    in every layer (3BASiL's total parameter budget)."""
    total = sum(m * n for m, n in shapes)
    factors = sum(rank * (m + n) for m, n in shapes)
    return sparsity - factors / total


def svd_rank(shapes: list[tuple[int, int]], fraction: float = 0.5) -> int:
    """One rank for every layer keeping ``fraction`` of the parameters in total."""
    return max(1, round(fraction * sum(m * n for m, n in shapes) / sum(m + n for m, n in shapes)))


def rows(s: Sizes, shapes: list[tuple[int, int]]) -> list[tuple[str, dict]]:
    """``[(label, compress config)]`` of one model."""
    r = s.rank
    budget = budget_sparsity(shapes, 0.5, r)
    out = [("dense", {"method": "none"})]
    for tag, pat in (("50%", {"sparsity": 0.5, "pattern": None}), ("2:4", {"pattern": "2:4"})):
        out += [(f"{m} {tag}", {"method": m, **pat}) for m in ("magnitude", "wanda", "sparsegpt")]
        out.append((f"3basil {tag} + r{r}", {"method": "3basil", "sparsity": 0.5, "rank": r,
                                             "pattern": pat.get("pattern")}))
    out.append((f"3basil 2:4 + r{r}, no TM", {"method": "3basil", "pattern": "2:4", "rank": r, "tm_epochs": 0}))
    out += [(f"{m} {budget:.1%} (3basil's budget)", {"method": m, "sparsity": round(budget, 6)})
            for m in ("wanda", "sparsegpt")]
    k = svd_rank(shapes)
    out += [(f"svd r{k}", {"method": "svd", "rank": k}),
            (f"svd whitened r{k}", {"method": "svd", "rank": k, "whiten": True})]
    out += [(f"{m} int{b}", {"method": m, "bits": b, "group_size": 128})
            for b in (4, 3) for m in ("rtn", "gptq", "glvq")]
    return [(label, {**cfg, **s.overrides.get(cfg["method"], {})}) for label, cfg in out]


KV_ROWS = (("fp", 16), ("nsnquant", 1), ("nsnquant", 2), ("kivi", 1), ("kivi", 2), ("kivi", 4))


def _llama(s: Sizes, console) -> tuple[torch.nn.Module, torch.Tensor, Windows, dict]:
    """Train the small Llama; return it with calibration and held-out byte windows."""
    from rankwise_bench.corpus import load_corpus
    from rankwise_bench.lowrank_pretrain import Sizes as PretrainSizes
    from rankwise_bench.lowrank_pretrain import build_model
    train, held, info = load_corpus()
    shape = dataclasses.replace(PretrainSizes(), hidden=s.llama_hidden, layers=s.llama_layers,
                                heads=s.llama_heads, intermediate=s.llama_intermediate,
                                seq=s.llama_seq, seed=s.seed)
    model = build_model(shape)
    g = torch.Generator().manual_seed(s.seed)
    span = torch.arange(s.llama_seq)

    def cut(data: torch.Tensor, n: int) -> torch.Tensor:
        return data[torch.randint(0, data.numel() - s.llama_seq, (n,), generator=g)[:, None] + span].long()

    data = Windows(cut(train, s.llama_steps * s.llama_batch))
    opt = torch.optim.AdamW(model.parameters(), lr=s.llama_lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, s.llama_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / warm if k < warm else 0.1 + 0.45 * (
        1 + math.cos(math.pi * (k - warm) / max(1, s.llama_steps - warm))))
    engine = Engine(model, get_task("causal-lm"), opt, data, s.llama_batch, seed=s.seed, scheduler=sched,
                    grad_clip=1.0)
    t0, losses = time.perf_counter(), []
    for k in range(s.llama_steps):
        losses.append(engine.train_step(k).loss)
        if console is not None and (k + 1) % max(1, s.llama_steps // 10) == 0:
            console.print(f"llama step {k + 1}/{s.llama_steps}: loss {sum(losses[-50:]) / len(losses[-50:]):.3f}")
    model.eval()
    info = {**info, "params": sum(p.numel() for p in model.parameters()), "train_s": time.perf_counter() - t0,
            "final_train_loss": sum(losses[-50:]) / len(losses[-50:]), "shape": asdict(shape)}
    return model, cut(train, s.calib_windows), Windows(cut(held, s.heldout_windows)), info


def _minilm(s: Sizes, work: Path, console) -> tuple[torch.nn.Module, torch.Tensor, object, dict]:
    """Train the demo's LoRA run, merge it, reload it as a plain transformers classifier."""
    from rankwise.compress.config import RUN_DATA, TextConfig
    from rankwise.data.text import build_data
    from rankwise.recipes.config import load_run_config
    from rankwise.commands.demo.run import demo_runs
    from rankwise.recipes.export import export_run
    from rankwise.recipes.model import load_model
    from rankwise.recipes.train import train
    raw = demo_runs()["lora"]
    raw["train"]["progress"] = False
    if s.minilm_steps:
        raw["train"]["steps"] = s.minilm_steps
    cfg = load_run_config(None, base=raw)
    run_dir, merged = work / "minilm-lora", work / "minilm-merged"
    for d in (run_dir, merged):
        shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    metrics = train(cfg, run_dir, console=console, summary=False)
    export_run(run_dir, "merged", merged)
    task = get_task("classification")
    model, tok = load_model(str(merged), task)
    model.eval()
    train_data, eval_data = build_data(cfg.data, task, tok)
    calib = token_windows(TextConfig(source=RUN_DATA, sequences=s.calib_windows, length=s.minilm_calib_length),
                          tok, "calibration", train_data)
    info = {"train_s": time.perf_counter() - t0, "run_eval_accuracy": metrics.get("eval_accuracy"),
            "params": sum(p.numel() for p in model.parameters()), "eval_examples": len(eval_data),
            "train_examples": len(train_data), "train": raw["train"]}
    return model, calib, eval_data, info


def _run_rows(name: str, dense: torch.nn.Module, task, calib, heldout, s: Sizes, console) -> list[dict]:
    from rankwise.compress.pipeline import check_layers
    from rankwise.core.weights import shape
    probe = registry.get("compressor", "none")
    identity = probe.builder(from_dict(probe.config_cls, {"method": "none"}, "compress"))
    paths = check_layers(dense, identity, "all-linear")
    shapes = [shape(dense.get_submodule(p)) for p in paths]
    before = evaluate(dense, task, heldout, 32)
    out = []
    for label, raw in rows(s, shapes):
        entry = registry.get("compressor", raw["method"])
        ccfg = from_dict(entry.config_cls, {**raw, "seed": s.seed}, "compress")
        model = copy.deepcopy(dense)
        report, _ = measure(model, task, ccfg, calib, heldout, console, progress=False, before=before)
        errs = [r["rel_error"] for r in report["layers"].values()]
        after = report["heldout"]["after"]
        row = {"model": name, "row": label, "config": raw,
               "quality": after.get("eval_accuracy", after.get("eval_perplexity")),
               "eval_loss": after["eval_loss"], "rel_error_mean": sum(errs) / len(errs), "rel_error_max": max(errs),
               "target_bytes": report["target_bytes_after"], "target_bytes_before": report["target_bytes_before"],
               "model_bytes": report["bytes_after"], "params": report["target_params_after"],
               "params_before": report["target_params_before"], "compress_s": report["time_s"]["compress"],
               "layers": {p: r["rel_error"] for p, r in report["layers"].items()}}
        out.append(row)
        if console is not None:
            console.print(f"{name} | {label}: quality {row['quality']:.4f}, rel. error {row['rel_error_mean']:.4f}, "
                          f"{row['target_bytes'] / 2**20:.3f} MiB, {row['compress_s']:.1f} s")
        del model
    return out


def kv_rows(head_dim: int, chunk: int) -> list[tuple[str, int, int]]:
    """``[(kind, nominal bits, chunk)]``: :data:`KV_ROWS` at ``chunk``, then KIVI at the stored
    bits per element of each NSNQuant row (equal total bytes)."""
    from rankwise.compress.kv import bits_per_element, kivi_for_budget
    out = [(kind, bits, chunk) for kind, bits in KV_ROWS]
    for kind, bits in KV_ROWS:
        if kind == "nsnquant":
            out.append(("kivi", *kivi_for_budget(bits_per_element(kind, bits, head_dim, chunk), head_dim)))
    return out


def _kv_rows(model, heldout: Windows, s: Sizes, console) -> list[dict]:
    from rankwise.compress.kv import cache_perplexity
    out = []
    for kind, bits, chunk in kv_rows(s.llama_hidden // s.llama_heads, s.kv_chunk):
        t0 = time.perf_counter()
        r = cache_perplexity(model, heldout.ids, kind, bits, chunk, s.kv_batch, seed=s.seed)
        out.append({"kind": kind, "bits": bits, "chunk": chunk, **r, "seconds": time.perf_counter() - t0})
        if console is not None:
            console.print(f"llama | KV {kind} {bits} bits, chunk {chunk}: perplexity {r['eval_perplexity']:.4f}, "
                          f"{r['bytes_per_token']:.1f} B/token, {r['bits_per_element']:.2f} bits/element")
    return out


def _table(rows_: list[dict], metric: str) -> str:
    lines = [f"| row | {metric} | mean rel. error | max rel. error | params kept | compressed layers MiB | "
             "whole model MiB | compress s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows_:
        q = f"{r['quality']:.2%}" if metric == "accuracy" else f"{r['quality']:.4f}"
        lines.append(f"| {r['row']} | {q} | {r['rel_error_mean']:.4f} | {r['rel_error_max']:.4f} | "
                     f"{r['params'] / r['params_before']:.1%} | {r['target_bytes'] / 2**20:.3f} | "
                     f"{r['model_bytes'] / 2**20:.3f} | {r['compress_s']:.1f} |")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [m for m in ("minilm", "llama") if m in results["models"]]
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.8), squeeze=False)
    colors = {"none": "k", "magnitude": "tab:gray", "wanda": "tab:blue", "sparsegpt": "tab:orange",
              "3basil": "tab:red", "svd": "tab:brown", "rtn": "tab:purple", "gptq": "tab:green", "glvq": "tab:pink"}
    for ax, name in zip(axes[0], names):
        res = results["models"][name]
        for r in res["rows"]:
            m = r["config"]["method"]
            ax.scatter(r["target_bytes"] / 2**20, r["quality"], c=colors.get(m, "tab:cyan"), s=22)
            ax.annotate(r["row"], (r["target_bytes"] / 2**20, r["quality"]), fontsize=6, alpha=0.8)
        metric = res["metric"]
        ax.set(xlabel="bytes of the compressed layers (MiB)", ylabel=f"held-out {metric}",
               title=f"{name}: {metric} vs bytes")
        if metric == "perplexity":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out: Path, sizes: Sizes | None = None, console=None) -> dict:
    """Run the benchmark; write ``results.json``, ``results.md`` and ``quality_vs_bytes.png``.

    Args:
        out: Output folder (created).
        sizes: Override the default :class:`Sizes` (tests use a tiny one).
        console: A ``rich`` console for progress lines (default: stderr).

    Returns:
        The results written to ``results.json``.
    """
    from rich.console import Console
    console = console or Console(stderr=True)
    s = sizes or Sizes()
    out = Path(out)
    work = out / "_work"
    work.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    began = time.time()
    results = {"sizes": asdict(s), "python": platform.python_version(), "torch": torch.__version__,
               "machine": f"{platform.machine()}, {s.threads} torch threads", "models": {}}
    try:
        if "minilm" in s.models:
            model, calib, heldout, info = _minilm(s, work, console)
            results["models"]["minilm"] = {"metric": "accuracy", "info": info,
                                           "rows": _run_rows("minilm", model, get_task("classification"),
                                                             calib, heldout, s, console)}
        if "llama" in s.models:
            model, calib, heldout, info = _llama(s, console)
            results["models"]["llama"] = {"metric": "perplexity", "info": info,
                                          "kv_cache": _kv_rows(model, heldout, s, console),
                                          "rows": _run_rows("llama", model, get_task("causal-lm"),
                                                            calib, heldout, s, console)}
    finally:
        torch.set_num_threads(threads)
        if not s.keep_models:
            shutil.rmtree(work, ignore_errors=True)
    results["wall_s"] = time.time() - began
    write_results(out, results, markdown(results))
    _plot(results, out / "quality_vs_bytes.png")
    return results


def markdown(results: dict) -> str:
    """``results.md`` from the record."""
    s = results["sizes"]
    md = ["# compress", "",
          f"Python {results['python']}, torch {results['torch']}, {results['machine']}; "
          f"wall {results['wall_s'] / 60:.1f} min. Produced by `rankwise bench compress`.", ""]
    if "minilm" in results["models"]:
        res = results["models"]["minilm"]
        i = res["info"]
        md += ["## MiniLM demo classifier (LoRA r=8 merged), accuracy on held-out docstrings", "",
               f"{i['params']:,} parameters; trained {i['train']['steps']} steps x {i['train']['batch_size']} "
               f"({i['train_examples']} training / {i['eval_examples']} held-out docstrings); calibration "
               f"{s['calib_windows']} windows x {s['minilm_calib_length']} tokens of training docstrings.", "",
               _table(res["rows"], "accuracy"), ""]
    if "llama" in results["models"]:
        res = results["models"]["llama"]
        i = res["info"]
        md += ["## Small Llama pretrained on stdlib source, perplexity per byte on held-out modules", "",
               f"Llama {s['llama_layers']}x{s['llama_hidden']} (intermediate {s['llama_intermediate']}, "
               f"{i['params']:,} parameters, byte tokens), AdamW {s['llama_steps']} steps x {s['llama_batch']} "
               f"x {s['llama_seq']} bytes (final train loss {i['final_train_loss']:.3f} nats/byte); "
               f"calibration {s['calib_windows']} and held-out {s['heldout_windows']} windows of "
               f"{s['llama_seq']} bytes.", "", _table(res["rows"], "perplexity"), "",
               "### KV cache (dense model, token-by-token decoding)", "",
               "Nominal bits label the codes; stored bits per element include the float16 metadata "
               "(scales, shifts, minima).", "",
               "| cache | nominal bits | chunk | stored bits / element | perplexity | "
               "bytes / token (all layers, K+V) | vs float16 |",
               "|---|---:|---:|---:|---:|---:|---:|"]
        for r in res["kv_cache"]:
            stored = r.get("bits_per_element", 16 * r["bytes_per_token"] / r["fp16_bytes_per_token"])
            md.append(f"| {r['kind']} | {r['bits']} | {r.get('chunk', '')} | {stored:.2f} | "
                      f"{r['eval_perplexity']:.4f} | {r['bytes_per_token']:.1f} | "
                      f"{r['bytes_per_token'] / r['fp16_bytes_per_token']:.3f} |")
        md.append("")
    return "\n".join(md)
