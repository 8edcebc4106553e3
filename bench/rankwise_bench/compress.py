"""``rankwise bench compress``: every compressor on two real models, in one process.

1. **MiniLM classifier**: the demo's LoRA run (``demo.yaml``'s ``lora``: all-MiniLM-L6-v2, LoRA
   r=8 on every linear layer, 90 steps x 32 stdlib docstrings), merged; quality = accuracy on
   its held-out docstrings; calibration = windows of its training docstrings.
2. **The reference base** (:func:`rankwise_bench.common.reference_base`: a 6.45M-parameter Llama
   that rankwise pretrained on the standard library's source, with its SentencePiece tokenizer),
   loaded as it is; ``Sizes.base`` names another folder (tests pass a tiny one). Calibration =
   windows of the training modules, quality = loss on windows of the held-out modules (the
   split it was pretrained with), per token and per byte (total nats / UTF-8 bytes of the scored
   tokens: :mod:`rankwise_bench.base_text`), so the byte numbers compare across tokenizers.

Decision (issue 35 item 2): compressing a model only means something for a trained one, so row 2
loads the reference base instead of training ``lowrank-pretrain``'s byte-level Llama for a few
minutes here (that code went to :mod:`rankwise_bench.restore` and is gone since that benchmark
loads the base too). The KV-cache rows run at the base's shape (head dim 64, 2 key/value heads).

Rows: the dense reference; magnitude, Wanda, SparseGPT and 3BASiL-TM at 50% unstructured and
2:4 (3BASiL adds a rank-r part, and also runs without TM at 2:4); Wanda and SparseGPT at the
unstructured sparsity that gives them 3BASiL's total parameter budget (nonzeros + factors);
SVD (plain and whitened) at 50% of the parameters; RTN, GPTQ and GLVQ at 4 and 3 bits (groups of
128 columns; GLVQ's groups must tile every layer, so on the base's 688-wide MLP it uses the
largest group that does). On the Llama also the KV caches: float, NSNQuant and KIVI at 1 and 2
bits, and KIVI at each NSNQuant row's stored bits per element (equal total bytes,
:func:`~rankwise.compress.kv.kivi_for_budget`).

``--set models=[llama]`` reruns one model: the other's committed record in ``OUT/results.json``
is kept. Every row is a piece (``OUT/pieces/MODEL/ROW.json``), reused when its settings match,
so a killed run continues where it stopped.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import platform
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.engine import evaluate, get_task
from rankwise.recipes.compress import Windows, measure, token_windows
from rankwise_bench.common import reference_base, write_json, write_results
from rankwise_bench.compress_report import markdown, plot

MODELS = ("minilm", "llama")


@dataclass
class Sizes:
    """Everything that sets the benchmark's size (default: about 25 min of one CPU core).

    Attributes:
        models: Which models to run (``minilm``, ``llama``); the others' records are kept.
        base: The causal LM of the ``llama`` rows, a folder transformers loads with its
            SentencePiece-style tokenizer (``None``: the reference base).
        llama_seq: Tokens per window of the base (calibration, held-out).
        calib_windows: Calibration windows (both models).
        heldout_windows: Held-out windows of the base.
        minilm_steps: Demo training steps (``None``: the demo's 90).
        minilm_calib_length: Tokens per MiniLM calibration window.
        rank: Rank of 3BASiL's low-rank part.
        overrides: Extra config keys per compressor (tests make them cheap).
        kv_chunk: Tokens per quantized KV chunk.
        kv_batch: Windows per KV-cache evaluation forward.
        threads: torch intra-op threads.
        seed: Seeds the compressors (and MiniLM's training).
        keep_models: Keep the trained MiniLM in ``out/_work`` (default: delete it).
    """

    models: tuple[str, ...] = MODELS
    base: str | None = None
    llama_seq: int = 256
    calib_windows: int = 64
    heldout_windows: int = 128
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


def tiling_group(shapes: list[tuple[int, int]], at_most: int = 128, multiple_of: int = 8) -> int:
    """The largest group of input columns, at most ``at_most`` and a multiple of ``multiple_of``
    (GLVQ's lattice dimension), that divides every layer's inputs (``multiple_of`` if none)."""
    width = math.gcd(*(n for _, n in shapes))
    fits = [g for g in range(multiple_of, at_most + 1, multiple_of) if width % g == 0]
    return max(fits, default=multiple_of)


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
    lattice = tiling_group(shapes)
    for b in (4, 3):
        for m in ("rtn", "gptq", "glvq"):
            group = lattice if m == "glvq" else 128
            out.append((f"{m} int{b}" + (f", group {group}" if group != 128 else ""),
                        {"method": m, "bits": b, "group_size": group}))
    return [(label, {**cfg, **s.overrides.get(cfg["method"], {})}) for label, cfg in out]


KV_ROWS = (("fp", 16), ("nsnquant", 1), ("nsnquant", 2), ("kivi", 1), ("kivi", 2), ("kivi", 4))


def _base(s: Sizes) -> tuple[torch.nn.Module, torch.Tensor, Windows, dict]:
    """The base in float32 with calibration windows (training modules), held-out windows and
    what they are (tokens and bytes scored)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rankwise_bench.base_text import base_info, module_stream, spaced_windows
    folder = Path(s.base) if s.base else reference_base()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    train_ids, train_bytes, train_info = module_stream(tok, heldout=False)
    held_ids, held_bytes, held_info = module_stream(tok, heldout=True)
    calib, _ = spaced_windows(train_ids, train_bytes, s.calib_windows, s.llama_seq)
    held, held_win_bytes = spaced_windows(held_ids, held_bytes, s.heldout_windows, s.llama_seq)
    info = base_info(folder, model, tok, train_info, held_info, held, held_win_bytes)
    return model, calib, Windows(held, pad_id=tok.pad_token_id or 0), info


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


def _setting(s: Sizes) -> dict:
    """The sizes a piece depends on (a piece measured at other settings is not reused)."""
    return {k: v for k, v in asdict(s).items() if k not in ("models", "threads", "keep_models", "overrides")}


class Pieces:
    """``OUT/pieces/MODEL/ROW.json``: one record per row, reused when its key matches."""

    def __init__(self, folder: Path, s: Sizes) -> None:
        self.folder, self.setting = folder, _setting(s)

    def _path(self, label: str) -> Path:
        return self.folder / (re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") + ".json")

    def get(self, label: str, config: dict) -> dict | None:
        """The stored record of ``label`` measured with ``config`` at these settings, or ``None``."""
        path = self._path(label)
        if not path.is_file():
            return None
        rec = json.loads(path.read_text())
        return rec["record"] if rec.get("key") == {"config": config, "setting": self.setting} else None

    def put(self, label: str, config: dict, record: dict) -> None:
        """Store ``record`` (atomically)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        write_json(self._path(label), {"key": {"config": config, "setting": self.setting}, "record": record})


def _run_rows(name: str, dense: torch.nn.Module, task, calib, heldout, s: Sizes, pieces: Pieces,
              per_byte: float | None, console) -> list[dict]:
    """Every row of :func:`rows` on a copy of ``dense``; ``per_byte`` = scored tokens / bytes."""
    from rankwise.compress.pipeline import check_layers
    from rankwise.core.weights import shape
    probe = registry.get("compressor", "none")
    identity = probe.builder(from_dict(probe.config_cls, {"method": "none"}, "compress"))
    paths = check_layers(dense, identity, "all-linear")
    shapes = [shape(dense.get_submodule(p)) for p in paths]
    before = None
    out = []
    for label, raw in rows(s, shapes):
        row = pieces.get(label, raw)
        if row is None:
            before = before or evaluate(dense, task, heldout, 32)
            entry = registry.get("compressor", raw["method"])
            ccfg = from_dict(entry.config_cls, {**raw, "seed": s.seed}, "compress")
            model = copy.deepcopy(dense)
            report, _ = measure(model, task, ccfg, calib, heldout, console, progress=False, before=before)
            del model
            errs = [r["rel_error"] for r in report["layers"].values()]
            after = report["heldout"]["after"]
            row = {"model": name, "row": label, "config": raw, "eval_loss": after["eval_loss"],
                   "quality": after["eval_loss"] * per_byte if per_byte else after["eval_accuracy"],
                   "rel_error_mean": sum(errs) / len(errs), "rel_error_max": max(errs),
                   "target_bytes": report["target_bytes_after"], "target_bytes_before": report["target_bytes_before"],
                   "model_bytes": report["bytes_after"], "params": report["target_params_after"],
                   "params_before": report["target_params_before"], "compress_s": report["time_s"]["compress"],
                   "layers": {p: r["rel_error"] for p, r in report["layers"].items()}}
            if per_byte:
                row["perplexity"] = after["eval_perplexity"]
            pieces.put(label, raw, row)
        out.append(row)
        if console is not None:
            console.print(f"{name} | {label}: quality {row['quality']:.4f}, rel. error {row['rel_error_mean']:.4f}, "
                          f"{row['target_bytes'] / 2**20:.3f} MiB, {row['compress_s']:.1f} s")
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


def _kv_rows(model, heldout: Windows, head_dim: int, s: Sizes, pieces: Pieces, per_byte: float, console) -> list[dict]:
    from rankwise.compress.kv import cache_perplexity
    out = []
    for kind, bits, chunk in kv_rows(head_dim, s.kv_chunk):
        label, config = f"kv {kind} {bits} bits chunk {chunk}", {"kind": kind, "bits": bits, "chunk": chunk}
        row = pieces.get(label, config)
        if row is None:
            t0 = time.perf_counter()
            r = cache_perplexity(model, heldout.ids, kind, bits, chunk, s.kv_batch, seed=s.seed)
            row = {**config, **r, "nats_per_byte": r["eval_loss"] * per_byte, "seconds": time.perf_counter() - t0}
            pieces.put(label, config, row)
        out.append(row)
        if console is not None:
            console.print(f"llama | KV {kind} {bits} bits, chunk {chunk}: {row['nats_per_byte']:.4f} nats/byte, "
                          f"{row['bytes_per_token']:.1f} B/token, {row['bits_per_element']:.2f} bits/element")
    return out


def _kept(out: Path, rerun: tuple[str, ...]) -> dict:
    """The committed records of the models not rerun (``OUT/results.json``), each with its own
    run (sizes, versions, wall time, command; a record from before runs were kept per model
    gets the record's top-level ones)."""
    path = out / "results.json"
    if not path.is_file():
        return {}
    prior = json.loads(path.read_text())
    kept = {}
    for name, res in prior.get("models", {}).items():
        if name in rerun:
            continue
        if "run" not in res:
            res = {**res, "run": {"sizes": prior["sizes"], "python": prior["python"], "torch": prior["torch"],
                                  "machine": prior["machine"], "wall_s": prior["wall_s"],
                                  "command": "rankwise bench compress --out bench/results/compress"}}
        kept[name] = res
    return kept


def _one(name: str, s: Sizes, work: Path, pieces: Path, console) -> dict:
    """Measure one model: its rows (and the KV caches of the causal LM)."""
    if name == "minilm":
        model, calib, heldout, info = _minilm(s, work, console)
        return {"metric": "accuracy", "info": info,
                "rows": _run_rows(name, model, get_task("classification"), calib, heldout, s,
                                  Pieces(pieces / name, s), None, console)}
    model, calib, heldout, info = _base(s)
    per_byte = info["scored_tokens"] / info["scored_bytes"]
    store = Pieces(pieces / name, s)
    return {"metric": "nats per byte", "info": info,
            "kv_cache": _kv_rows(model, heldout, info["shape"]["head_dim"], s, store, per_byte, console),
            "rows": _run_rows(name, model, get_task("causal-lm"), calib, heldout, s, store, per_byte, console)}


def run(out: Path, sizes: Sizes | None = None, console=None, command: str | None = None) -> dict:
    """Run the benchmark; write ``results.json``, ``results.md`` and ``quality_vs_bytes.png``.

    Args:
        out: Output folder (created); the records of models not in ``sizes.models`` are kept.
        sizes: Override the default :class:`Sizes` (tests use a tiny one).
        console: A ``rich`` console for progress lines (default: stderr).
        command: The command line recorded with each model (default: the plain command).

    Returns:
        The results written to ``results.json``.

    Raises:
        RankwiseError: An unknown model, or no reference base built.
    """
    from rich.console import Console

    from rankwise.errors import RankwiseError
    console = console or Console(stderr=True)
    s = sizes or Sizes()
    unknown = [m for m in s.models if m not in MODELS]
    if unknown:
        raise RankwiseError(f"compress models: got {unknown}; expected some of {list(MODELS)}")
    out = Path(out)
    work = out / "_work"
    work.mkdir(parents=True, exist_ok=True)
    measured = dict(_kept(out, s.models))
    with_threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        for name in [m for m in MODELS if m in s.models]:
            began = time.time()
            res = _one(name, s, work, out / "pieces", console)
            res["run"] = {"sizes": asdict(s), "python": platform.python_version(), "torch": torch.__version__,
                          "machine": f"{platform.machine()}, {s.threads} torch threads",
                          "wall_s": time.time() - began,
                          "command": command or f"rankwise bench compress --out {out}"}
            measured[name] = res
    finally:
        torch.set_num_threads(with_threads)
        if not s.keep_models:
            shutil.rmtree(work, ignore_errors=True)
    results = {"models": {m: measured[m] for m in MODELS if m in measured}}
    write_results(out, results, markdown(results))
    plot(results, out / "quality_vs_bytes.png")
    return results


def main(argv: list[str] | None = None) -> dict:
    """``rankwise bench compress --out DIR [--set models=[llama]] [--set base=FOLDER] ...``."""
    from rankwise_bench.common import preset_main
    return preset_main(argv, name="compress", doc=__doc__, presets={"default": Sizes()}, default="default",
                       run=run)


__all__ = ["Sizes", "budget_sparsity", "kv_rows", "main", "markdown", "rows", "run", "svd_rank", "tiling_group"]
