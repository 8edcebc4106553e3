"""``rankwise compress CONFIG [--set ...] [--out DIR] [--overwrite]``.

CONFIG is a run config (``model:``, optionally ``data:``) plus a ``compress:`` section whose
schema is the chosen compressor's config class. ``model.path`` is a local Hugging Face folder
or a finished ``rankwise train`` run (its adapters are merged first). The output folder holds
the compressed model for ``AutoModel*.from_pretrained`` (decoded, dense weights),
``compression.safetensors`` (the compact form), ``report.json`` and ``report.md``.
"""
from __future__ import annotations

import csv
import json
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from rankwise import registry
from rankwise.compress import build
from rankwise.compress.config import RUN_DATA, STDLIB, STDLIB_HELDOUT, TextConfig
from rankwise.compress.pipeline import Result, check_layers, compress_model
from rankwise.configs import to_dict
from rankwise.errors import RankwiseError
from rankwise.recipes import folders
from rankwise.recipes.config import RunConfig, apply_sets, build_run_config, read_yaml

SKIP = {"test", "tests", "idlelib", "site-packages", "__pycache__"}


class Windows:
    """Fixed-length token windows as evaluation examples (``input_ids`` lists, no padding)."""

    def __init__(self, ids: torch.Tensor, pad_id: int = 0) -> None:
        self.ids, self.pad_id = ids, pad_id

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        """Window ``i``."""
        return {"input_ids": self.ids[i].tolist()}


def parse_config(data: dict) -> tuple[RunConfig, Any]:
    """Validate a raw config into the run config and its ``compress:`` section (a typed section
    of :class:`RunConfig`, like ``method:``).

    Raises:
        RankwiseError: Every problem at once (unknown keys with suggestions), or no ``compress:``.
    """
    run_cfg = build_run_config(data)
    if run_cfg.compress is None:
        raise RankwiseError(f"compress.method is required; one of: {', '.join(registry.names('compressor'))}")
    if run_cfg.model.quantize:
        raise RankwiseError("rankwise compress needs full-precision weights; remove model.quantize")
    return run_cfg, run_cfg.compress


def load_config(path: Path, sets: list[str]) -> tuple[RunConfig, Any, dict]:
    """Read CONFIG, apply ``--set``, validate; also returns the raw dict."""
    data = apply_sets(read_yaml(path), list(sets))
    run_cfg, ccfg = parse_config(data)
    return run_cfg, ccfg, data


def stdlib_texts(heldout: bool) -> Iterator[str]:
    """Source files of the running Python's standard library (tests, idlelib, site-packages
    left out): a module is held out when ``crc32(module name) % 10 == 0`` (the split of the
    low-rank pretraining benchmark). Files come in ``crc32`` order, a fixed mix of packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if SKIP & set(rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts)
        if (zlib.crc32(module.encode()) % 10 == 0) == heldout:
            files.append((zlib.crc32(module.encode()), str(rel), f))
    for _, _, f in sorted(files):
        yield f.read_text(encoding="utf-8", errors="replace")


def file_texts(path: str, field: str, what: str) -> Iterator[str]:
    """Texts of a ``.txt`` (whole file), ``.jsonl`` or ``.csv`` (column ``field``) file."""
    p = Path(path)
    if not p.is_file():
        raise RankwiseError(f"{what}.source {path!r} is not a file; use stdlib, stdlib-heldout, data "
                            "or a .txt/.jsonl/.csv file")
    if p.suffix == ".txt":
        yield p.read_text(encoding="utf-8", errors="replace")
        return
    if p.suffix not in (".jsonl", ".csv"):
        raise RankwiseError(f"{what}.source {path}: expected a .txt, .jsonl or .csv file")
    with p.open(encoding="utf-8", errors="replace", newline="") as f:
        rows = csv.DictReader(f) if p.suffix == ".csv" else (json.loads(x) for x in f if x.strip())
        for n, row in enumerate(rows, 1):
            if not isinstance(row, dict) or row.get(field) in (None, ""):
                raise RankwiseError(f"{what}.source {path}: record {n} has no {field!r}; set "
                                    f"{what}.text_field to the text column")
            yield str(row[field])


def special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens a tokenizer puts before and after a text (``[CLS]``/``[SEP]``,
    ``<s>``), found by encoding a probe with and without them."""
    plain = tokenizer("probe text", add_special_tokens=False)["input_ids"]
    full = tokenizer("probe text")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return [], []


def token_windows(src: TextConfig, tokenizer, what: str, run_data=None) -> torch.Tensor:
    """``(sequences, length)`` token windows cut from a text source, consecutive in its stream.

    Args:
        src: The source (``compress.calibration`` or ``compress.heldout``).
        tokenizer: A transformers tokenizer (special tokens are added to each window).
        what: The config key for messages.
        run_data: With ``source: data``, the run's tokenized training examples.

    Raises:
        RankwiseError: The source is missing or gives fewer tokens than asked.
    """
    head, tail = special_affixes(tokenizer)
    specials = len(head) + len(tail)
    inner = src.length - specials
    if inner < 1:
        raise RankwiseError(f"{what}.length {src.length} leaves no room beside {specials} special tokens")
    need = src.sequences * inner
    if src.source == RUN_DATA:
        pieces = (run_data[i]["input_ids"] for i in range(len(run_data)))
    else:
        texts = (stdlib_texts(src.source == STDLIB_HELDOUT) if src.source in (STDLIB, STDLIB_HELDOUT)
                 else file_texts(src.source, src.text_field, what))
        pieces = (tokenizer(t + "\n", add_special_tokens=False)["input_ids"] for t in texts)
    stream: list[int] = []
    for piece in pieces:
        stream.extend(piece)
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise RankwiseError(f"{what}: {src.source} gives {len(stream):,} tokens but sequences x length asks "
                            f"for {need:,}; lower {what}.sequences or {what}.length, or use a longer source")
    rows = [head + stream[i * inner:(i + 1) * inner] + tail for i in range(src.sequences)]
    return torch.tensor(rows, dtype=torch.long)


def load_input(run_cfg: RunConfig, raw: dict, model_path: Path | None = None
               ) -> tuple[nn.Module, Any, Any, RunConfig]:
    """The model to compress: a Hugging Face folder, or a run folder with adapters merged.

    Args:
        run_cfg: The validated run config (``model.path`` names the model or the run).
        raw: The raw config (a ``data:`` section there replaces the run's own).
        model_path: ``--model``: where a run's base model is now, if it moved.

    Returns:
        ``(model, tokenizer, task, run config)``; for a run, its own config (with the
        CONFIG's ``data:`` section when CONFIG has one).

    Raises:
        RankwiseError: A missing folder, a folder without weights, or a bad run.
    """
    from rankwise.engine import get_task
    from rankwise.recipes.model import TINY, load_model
    path = Path(run_cfg.model.path)
    if path.is_dir() and (path / "config.yaml").is_file() and not (path / "config.json").is_file():
        from rankwise.core.merged import merge_plain
        from rankwise.recipes.export import load_run, merged_dtype
        own, model, tok = load_run(path, model_path)
        if raw.get("data") is not None:
            own.data = run_cfg.data
        model = merge_plain(model, dtype=merged_dtype(own))  # as export --format merged writes it
        return model, tok, get_task(own.task.name), own
    if model_path is not None:
        raise RankwiseError(f"--model names the base model of a run, but model.path {str(path)!r} "
                            "is not a run folder; set model.path to the model to compress")
    if run_cfg.model.path not in TINY and run_cfg.model.path != "demo" and path.is_dir():
        weights = [p for pat in ("*.safetensors", "*.bin") for p in path.glob(pat)]
        if (path / "config.json").is_file() and not weights:
            raise RankwiseError(f"model folder {path} has no weights (*.safetensors or *.bin); point "
                                "model.path at a folder written by save_pretrained, or at a rankwise run")
    task = get_task(run_cfg.task.name)
    m = run_cfg.model
    model, tok = load_model(m.path, task, m.num_labels, seed=run_cfg.train.seed,
                            add_tokens=m.add_tokens, add_special_tokens=m.add_special_tokens)
    return model, tok, task, run_cfg


def _nbytes_calib(model: nn.Module, calib: torch.Tensor) -> int:
    """Bytes of the hidden states entering every block at once (float32), for comparison."""
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", 0) or 0
    layers = getattr(cfg, "num_hidden_layers", 0) or 0
    return calib.numel() * hidden * layers * 4


def _param_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _compress_with_bar(model: nn.Module, compressor, batches: list, ccfg, console,
                       progress: bool) -> Result:
    """Compress ``model`` layer by layer behind a progress bar."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.fields[layer]}"),
                   console=console or Console(stderr=True), disable=not progress)
    with bar:
        job = bar.add_task(f"compress {ccfg.method}", total=None, layer="")
        return compress_model(model, compressor, batches, ccfg.targets,
                              on_layer=lambda p, k, n: bar.update(job, completed=k, total=n, layer=p))


def _restore(model: nn.Module, task, ccfg, calib: torch.Tensor, heldout, restorer) -> tuple[dict, float]:
    """Evaluate the pruned model, then restore it; ``(report["restore"], seconds restoring)``."""
    from rankwise.engine import evaluate
    pruned = evaluate(model, task, heldout, ccfg.batch_size)
    t2 = time.perf_counter()
    restored = {**restorer.restore(model, calib, ccfg.batch_size), "seconds": time.perf_counter() - t2,
                "heldout_pruned": pruned}
    return restored, time.perf_counter() - t2


def _kv_cache(model: nn.Module, task, ccfg, heldout) -> dict | None:
    """The held-out perplexity under the KV cache ``compress.kv_cache`` names, if set: its
    settings (``name``, ``bits``, ``chunk``) beside the measurement."""
    if ccfg.kv_cache is None or not task.lm_loss:
        return None
    from rankwise.compress.kv import cache_perplexity
    return {**to_dict(ccfg.kv_cache),
            **cache_perplexity(model, heldout.ids, ccfg.kv_cache, batch_size=ccfg.batch_size, seed=ccfg.seed)}


def measure(model: nn.Module, task, ccfg, calib: torch.Tensor, heldout, console=None,
            progress: bool = True, before: dict | None = None) -> tuple[dict, Result]:
    """Evaluate, compress in place, evaluate again; the report dict (``report.json``'s shape).

    Args:
        model: The model (changed in place).
        task: Its :class:`~rankwise.engine.task.Task`.
        ccfg: The validated ``compress:`` config.
        calib: ``(N, T)`` calibration token windows.
        heldout: Held-out examples for ``rankwise.engine.evaluate``.
        console: A ``rich`` console for the progress bar (default: stderr).
        progress: Show the layer-by-layer progress bar.
        before: The dense model's held-out metrics if already known (benchmarks reuse them).

    Returns:
        ``(report, result)``.

    Raises:
        RankwiseError: From the compressor's per-layer checks or the KV-cache settings.
    """
    from rankwise.engine import evaluate
    began = time.perf_counter()
    compressor = build(ccfg)
    check_layers(model, compressor, ccfg.targets)          # every per-layer problem, before any work
    restorer = _restorer(model, task, ccfg)
    bytes_before = _param_bytes(model)
    t0 = time.perf_counter()
    before = before if before is not None else evaluate(model, task, heldout, ccfg.batch_size)
    t_eval = time.perf_counter() - t0
    chunks = calib.split(ccfg.batch_size)
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in chunks]
    if restorer is not None:
        restorer.record_dense(model, calib, ccfg.batch_size)
    result = _compress_with_bar(model, compressor, batches, ccfg, console, progress)
    t1 = time.perf_counter()
    restored = None
    if restorer is not None:
        restored, spent = _restore(model, task, ccfg, calib, heldout, restorer)
        t1 += spent
    after = evaluate(model, task, heldout, ccfg.batch_size)
    kv = _kv_cache(model, task, ccfg, heldout)
    t_eval += time.perf_counter() - t1
    tb = sum(r["bytes_before"] for r in result.report.values())
    ta = sum(r["bytes_after"] for r in result.report.values())
    key = "eval_accuracy" if task.uses_labels else "eval_perplexity"
    report = {
        "method": ccfg.method, "config": to_dict(ccfg), "task": task.name,
        "bytes_before": bytes_before, "bytes_after": bytes_before - tb + ta,
        "target_bytes_before": tb, "target_bytes_after": ta,
        "target_params_before": sum(r["params_before"] for r in result.report.values()),
        "target_params_after": sum(r["params_after"] for r in result.report.values()),
        "heldout": {"metric": key.removeprefix("eval_"), "before": before, "after": after,
                    "examples": len(heldout), **({"kv_cache": kv} if kv else {})},
        "calibration": {"sequences": int(calib.shape[0]), "length": int(calib.shape[1]),
                        "source": ccfg.calibration.source},
        "time_s": {"compress": result.seconds, "eval": t_eval, "total": time.perf_counter() - began},
        # what the streamed pass holds at once vs what keeping every block's inputs would hold
        "activation_mb_peak": result.held_bytes / 2**20,
        "activation_mb_all_blocks": _nbytes_calib(model, calib) / 2**20,
        "layers": result.report,
    }
    if restored is not None:
        report["restore"] = restored
    return report, result


def _restorer(model: nn.Module, task, ccfg):
    """The RestoreLCC step of ``compress.restore`` (``None`` when off), checked before any work."""
    if not ccfg.restore.enabled:
        return None
    from rankwise.compress.restore import RestoreLCC, check_restorable
    paths = check_restorable(model, ccfg, task)
    return RestoreLCC(ccfg.restore, paths, model.config.num_attention_heads, seed=ccfg.seed)


def check_output(out: Path, inputs: dict[str, Any], overwrite: bool) -> None:
    """Refuse an output folder that would lose data; ``--overwrite`` replaces only an earlier
    compress output, and only when it holds nothing but the files that compress recorded.

    Args:
        out: The output folder.
        inputs: ``{option: path or None}`` of the folders compress reads (``model.path``,
            ``--model``).
        overwrite: ``--overwrite``.

    Raises:
        RankwiseError: ``out`` is or contains an input (the model or run being compressed),
            holds something other than a compress output, is a non-empty compress output
            without ``--overwrite``, or holds files compress did not write.
    """
    target = out.expanduser().resolve()
    for option, path in inputs.items():
        source = Path(path).expanduser() if path is not None else None
        if source is not None and source.is_dir():
            source = source.resolve()
            if source == target or target in source.parents:
                raise RankwiseError(f"--out {out} contains {option} {path} (the model being "
                                    "compressed); choose another --out, --overwrite or not")
    found = folders.check_kind(out, "compress", "--overwrite replaces only an earlier compress "
                               "output: choose another --out")
    if found is None:
        return
    if not overwrite:
        raise RankwiseError(f"output folder {out} is not empty; choose a new --out or pass --overwrite")
    saved = folders.read_record(out) or {}
    if not isinstance(saved.get("files"), list):
        raise RankwiseError(f"--out {out} holds a compress output written before compress recorded "
                            "its files, so --overwrite cannot tell them from yours; delete it yourself "
                            "or choose another --out")
    ours = {Path(f).parts[0] for f in saved["files"]} | {folders.RECORD}
    extra = [n for n in folders.entries(out) if n not in ours]
    if extra:
        raise RankwiseError(f"--out {out} also holds {', '.join(extra[:3])}"
                            f"{' ...' if len(extra) > 3 else ''}, which compress did not write; "
                            "--overwrite replaces only compress's own files: move those away or "
                            "choose another --out")


def run_compress(config: Path, sets: list[str], out: Path, overwrite: bool = False,
                 console=None, progress: bool = True, model_path: Path | None = None) -> dict:
    """The ``rankwise compress`` command: load, measure, write the output folder atomically.

    ``model_path`` (``--model``) is where the base model of a run named by ``model.path`` is
    now, if it moved.

    Returns:
        The report (also written as ``report.json``).

    Raises:
        RankwiseError: On any bad input (config, model folder, text sources, output folder).
    """
    from rankwise.compress.io import save_compressed
    from rankwise.compress.report import summary_line, to_markdown
    from rankwise.core import atomic
    from rankwise.data.text import build_data
    out = atomic.check_folder(out)
    run_cfg, ccfg, raw = load_config(config, sets)
    if ccfg.restore.enabled:
        from rankwise.compress.restore import check_restore_config
        check_restore_config(ccfg)                    # before loading the model
    check_output(out, {"model.path": run_cfg.model.path, "--model": model_path}, overwrite)
    model, tok, task, run_cfg = load_input(run_cfg, raw, model_path)
    if not (task.lm_loss or task.uses_labels):  # perplexity, or accuracy on labelled records
        raise RankwiseError(f"rankwise compress evaluates causal-lm or classification models, not "
                            f"{task.name}; set task.name: causal-lm")
    needs_data = task.uses_labels or ccfg.calibration.source == RUN_DATA
    train_data, eval_data = build_data(run_cfg.data, task, tok) if needs_data else (None, None)
    calib = token_windows(ccfg.calibration, tok, "compress.calibration", train_data)
    heldout = eval_data if task.uses_labels else Windows(
        token_windows(ccfg.heldout, tok, "compress.heldout", train_data), tok.pad_token_id or 0)
    report, result = measure(model, task, ccfg, calib, heldout, console, progress)
    report["model"] = run_cfg.model.path
    with atomic.folder(out) as tmp:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        save_compressed(tmp / "compression.safetensors", ccfg.method, to_dict(ccfg), result.layers)
        atomic.write_json(tmp / "report.json", report)
        (tmp / "report.md").write_text(to_markdown(report))
        written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        folders.record(tmp, "compress", files=written)  # what a later --overwrite may replace
    if console is not None:
        console.print(summary_line(report))
    return report
