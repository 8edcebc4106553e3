"""``rankwise export RUN_DIR --format peft|merged|rankwise|gguf|gguf-lora --out DIR``.

Every ``peft`` export records and prints which servers load it as it is
(:mod:`rankwise.core.servability`); ``strict`` refuses one a named server would reject.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Iterable

from rankwise import registry
from rankwise.core import atomic
from rankwise.core.io import load_adapter
from rankwise.engine import get_task
from rankwise.errors import RankwiseError
from rankwise.recipes import folders
from rankwise.recipes.config import load_run_config
from rankwise.recipes.model import base_moved, demo_model_path, load_model, torch_dtype
from rankwise.recipes.tokens import run_tokenizer

BUILTIN_FORMATS = ("merged", "rankwise", "gguf", "gguf-lora")
GGUF_FORMATS = ("gguf", "gguf-lora")


def formats() -> list[str]:
    """Every export format: the built-in ones and the registered exporters (``peft``)."""
    return sorted(set(BUILTIN_FORMATS) | set(registry.names("exporter")))


def load_run(run_dir: Path, model_path: str | Path | None = None):
    """Rebuild a finished run's trained model from its folder.

    Args:
        run_dir: The run folder.
        model_path: The base model's folder, when it is no longer where the run's
            ``config.yaml`` says (moved, another machine); default: ``model.path``.

    Returns:
        ``(cfg, model, tokenizer)`` with the adapter loaded (or the fully trained model).

    Raises:
        RankwiseError: If the folder is not a finished run or its files are corrupt.
    """
    run_dir = Path(run_dir)
    folders.check_run(run_dir, "this command")
    if not (run_dir / "config.yaml").is_file():
        raise RankwiseError(f"{run_dir} is not a run folder (no config.yaml); pass the --out folder "
                            "of a finished 'rankwise train'")
    cfg = load_run_config(run_dir / "config.yaml", notice=False)
    if model_path is not None:
        cfg.model.path = str(model_path)
    entry = registry.get("method", cfg.method.name)
    if entry.trains == "full":
        if not (run_dir / "model" / "config.json").is_file():
            raise RankwiseError(f"{run_dir} has no trained model/ yet; let the run finish (or --resume it)")
        model, tok = load_model(str(run_dir / "model"), get_task(cfg.task.name), cfg.model.num_labels)
        return cfg, model, tok
    if not (run_dir / "adapter").is_dir():
        raise RankwiseError(f"{run_dir} has no adapter/ yet; let the run finish (or --resume it)")
    m = cfg.model
    try:
        model, tok = load_model(m.path, get_task(cfg.task.name), m.num_labels, seed=cfg.train.seed,
                                dtype=m.dtype, quantize=m.quantize, double_quant=m.double_quant,
                                add_tokens=m.add_tokens, add_special_tokens=m.add_special_tokens)
    except RankwiseError as err:
        if "not found" not in str(err):
            raise
        raise base_moved(err) from None
    tok = run_tokenizer(run_dir, tok)  # the run's own copy when it added tokens
    try:
        load_adapter(model, run_dir / "adapter")
    except RankwiseError as err:
        if "corrupt" not in str(err):
            raise
        raise RankwiseError(f"{err.args[0].split(';')[0]}; write it again from the run's last "
                            f"checkpoint: rankwise train {run_dir / 'config.yaml'} --resume "
                            f"--out {run_dir}") from None
    model.eval()
    return cfg, model, tok


def merged_dtype(cfg) -> torch.dtype | None:
    """The dtype of a run's merged model: ``model.dtype``; for a quantized base ``None``, i.e.
    its dequantized weights in bf16 (:func:`rankwise.core.merged.merge_plain`)."""
    return None if cfg.model.quantize else torch_dtype(cfg.model.dtype)


def _check_options(fmt: str, outtype: str | None, strict: list[str], llama_cpp_dir) -> None:
    """Refuse options the format does not take, before the run is loaded."""
    from rankwise.core import llama_cpp, servability
    if fmt not in formats():
        raise RankwiseError(f"unknown export format {fmt!r}; expected one of: {', '.join(formats())}")
    if strict and fmt != "peft":
        raise RankwiseError(f"--strict checks a PEFT adapter for a server; it does not apply to "
                            f"--format {fmt} (use --format peft)")
    servability.enforce([], strict)  # unknown server names
    if fmt in GGUF_FORMATS:
        llama_cpp.check_outtype(outtype or "f16")
        llama_cpp.find(llama_cpp_dir)
    elif outtype is not None or llama_cpp_dir is not None:
        raise RankwiseError(f"--outtype / --llama-cpp apply to --format gguf or gguf-lora, not {fmt}")


def export_run(run_dir: Path, fmt: str, out: Path, model_path: str | Path | None = None,
               strict: Iterable[str] = (), outtype: str | None = None,
               llama_cpp_dir: str | Path | None = None, with_base: bool = False,
               echo: Callable[[str], None] = print) -> Path:
    """Export a run's result.

    Args:
        run_dir: A finished run folder.
        fmt: ``peft`` (adapter_config.json + adapter_model.safetensors + the tokenizer files),
            ``merged`` (a plain transformers model folder with the adapter folded in),
            ``rankwise``, ``gguf`` (the merged model as one GGUF file) or ``gguf-lora`` (a LoRA
            GGUF for the base's GGUF), see :mod:`rankwise.recipes.export_gguf`.
        out: Target folder; must not exist or be empty.
        model_path: Where the base model is now, if it moved (see :func:`load_run`).
        strict: ``peft`` only: servers (``vllm``, ``llama.cpp``, ``peft-hotswap``) that must
            load the adapter as it is; one that would refuse it stops the export, nothing written.
        outtype: GGUF tensor type (``f32``, ``f16`` (default), ``bf16``, ``q8_0``).
        llama_cpp_dir: The folder of llama.cpp's converters (see :func:`rankwise.core.llama_cpp.find`).
        with_base: ``gguf-lora`` only: also convert the base model.
        echo: Where notices go (the servers that load a PEFT export, a GGUF's llama.cpp command).

    Returns:
        The folder written.

    Raises:
        RankwiseError: Bad run folder, a non-empty target, a format the run can't produce, or
            a server named in ``strict`` that would refuse the adapter.
    """
    strict = list(strict)
    _check_options(fmt, outtype, strict, llama_cpp_dir)
    out = atomic.check_folder(out)
    if out.exists() and any(out.iterdir()):
        raise RankwiseError(f"export target {out} is not empty; choose a new --out or delete it first")
    cfg, model, tok = load_run(run_dir, model_path)
    full = registry.get("method", cfg.method.name).trains == "full"
    if fmt in GGUF_FORMATS:
        from rankwise.recipes import export_gguf
        if fmt == "gguf":
            return export_gguf.write_gguf(cfg, model, tok, out, outtype or "f16", llama_cpp_dir,
                                          merged_dtype(cfg))
        return export_gguf.write_gguf_lora(cfg, model, out, outtype or "f16", llama_cpp_dir,
                                           with_base, echo)
    if fmt == "merged":
        from rankwise.core.merged import export_merged
        return export_merged(model, out, tokenizer=tok, dtype=merged_dtype(cfg))
    if full:
        raise RankwiseError(f"run {run_dir} trained every weight ({cfg.method.name}); it has no "
                            "adapter to export: use --format merged")
    if fmt == "rankwise":
        shutil.copytree(Path(run_dir) / "adapter", out, dirs_exist_ok=True)
        return out
    return _export_peft(cfg, model, tok, out, strict, echo)


def _export_peft(cfg, model, tok, out: Path, strict: list[str], echo) -> Path:
    """The ``peft`` folder with the tokenizer files, and the servers that load it as it is."""
    from rankwise.core import servability
    from rankwise.core.tokenizer_files import save_tokenizer_files
    base = str(demo_model_path()) if cfg.model.path == "demo" else cfg.model.path
    # a method whose files have their own layout in this format brings its own writer
    writer = registry.get("method", cfg.method.name).exporters.get("peft") or registry.get("exporter", "peft").builder
    written = writer(model, out, base_model_name_or_path=base)
    findings = servability.check(servability.read_folder(written)) \
        if (Path(written) / "adapter_config.json").is_file() and _is_lora(written) else None
    try:
        if findings is not None:
            servability.enforce(findings, strict)
    except RankwiseError:
        shutil.rmtree(written)  # the folder this call created: nothing a server would refuse is left
        raise
    save_tokenizer_files(tok, written)  # so a server or converter tokenizes as transformers does
    if findings is not None:
        servability.record(written, findings)
        echo("servers that load this adapter as it is (servability.json):")
        for line in servability.summary(findings):
            echo(line)
    elif strict:
        shutil.rmtree(written)
        raise RankwiseError(f"--strict: this is not a LoRA adapter ({cfg.method.name}); no server "
                            "named loads it: export the merged model with --format merged")
    elif (Path(written) / "adapter_config.json").is_file():  # prompt tuning: PEFT's loader only
        echo("servers that load this adapter as it is:")
        echo(f"  PEFT: loads it; {servability.peft_line(servability.read_folder(written))}")
    return written


def _is_lora(folder: Path) -> bool:
    import json
    return json.loads((Path(folder) / "adapter_config.json").read_text()).get("peft_type") == "LORA"
