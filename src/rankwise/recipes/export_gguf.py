"""``rankwise export RUN --format gguf|gguf-lora``: a run for llama.cpp, Ollama and LM Studio,
written by llama.cpp's own converters (:mod:`rankwise.core.llama_cpp`).

* ``gguf``: the merged model (the ``merged`` export, with every tokenizer file of the base, so the
  converter finds the SentencePiece ``tokenizer.model``) converted by ``convert_hf_to_gguf.py``
  into ``OUT/model-<outtype>.gguf``. Any run whose adapter merges, and full fine-tunes.
* ``gguf-lora``: the ``peft`` export converted by ``convert_lora_to_gguf.py`` into
  ``OUT/adapter-<outtype>.gguf``, which ``llama-cli -m BASE.gguf --lora ADAPTER.gguf`` applies to
  the base's own GGUF (``--with-base`` writes that too, as ``OUT/base-<outtype>.gguf``). Only
  what llama.cpp can apply: a LoRA without DoRA magnitudes, trained whole modules or token rows,
  on a base whose vocabulary the run kept; the rest is refused in one line naming ``--format
  gguf``. rsLoRA and per-layer alphas are folded into ``lora_B`` first
  (:func:`rankwise.core.llama_cpp.fold_scales`), since llama.cpp scales every pair by ``alpha/r``.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

from rankwise import registry
from rankwise.core import atomic, llama_cpp, servability
from rankwise.errors import RankwiseError
from rankwise.recipes.model import demo_model_path
from rankwise.recipes.tokens import adds_tokens

MERGED_ROUTE = "export the merged model with --format gguf"


def base_folder(cfg: Any) -> Path:
    """The run's base model folder (``model.path``; the packaged MiniLM for ``demo``)."""
    return Path(demo_model_path()) if cfg.model.path == "demo" else Path(cfg.model.path)


def write_gguf(cfg: Any, model: Any, tok: Any, out: Path, outtype: str, llama_cpp_dir: Path | None,
               dtype: Any) -> Path:
    """The merged model as ``OUT/model-<outtype>.gguf`` (written whole or not at all).

    Raises:
        RankwiseError: An adapter that does not merge, or a converter failure (one line).
    """
    from rankwise.core.merged import export_merged
    with atomic.folder(out) as tmp:
        hf = export_merged(model, tmp / "merged", tokenizer=tok, dtype=dtype)
        llama_cpp.convert_model(hf, tmp / f"model-{outtype}.gguf", outtype, llama_cpp_dir)
        shutil.rmtree(hf)
    return out


def _lora_refusal(cfg: Any, full: bool) -> str | None:
    """Why this run has no LoRA GGUF before any file is written (``None``: try)."""
    if full:
        return f"run trained every weight ({cfg.method.name}): it has no adapter"
    if adds_tokens(cfg.model):
        return "the run added tokens (model.add_tokens), so the base's GGUF lacks their rows"
    return None


def write_gguf_lora(cfg: Any, model: Any, out: Path, outtype: str, llama_cpp_dir: Path | None,
                    with_base: bool, echo: Callable[[str], None]) -> Path:
    """The adapter as ``OUT/adapter-<outtype>.gguf`` (and the base as ``base-<outtype>.gguf``).

    Raises:
        RankwiseError: A run llama.cpp's LoRA loader cannot apply (naming ``--format gguf``), or
            a converter failure.
    """
    full = registry.get("method", cfg.method.name).trains == "full"
    why = _lora_refusal(cfg, full)
    if why:
        raise RankwiseError(f"no LoRA GGUF for this run: {why}; {MERGED_ROUTE}")
    base = base_folder(cfg)
    writer = registry.get("method", cfg.method.name).exporters.get("peft") or registry.get("exporter", "peft").builder
    with atomic.folder(out) as tmp:
        try:
            peft_dir = writer(model, tmp / "peft", base_model_name_or_path=str(base))
        except RankwiseError as err:  # non-LoRA layers, mixed DoRA, LoftQ ...
            raise RankwiseError(f"no LoRA GGUF for this run ({err.args[0].split(';')[0]}); "
                                f"{MERGED_ROUTE}") from None
        adapter = servability.read_folder(peft_dir)
        if adapter.config.get("peft_type") != "LORA":
            raise RankwiseError(f"no LoRA GGUF for this run: llama.cpp applies LoRA adapters only "
                                f"(this is {adapter.config.get('peft_type')}); {MERGED_ROUTE}")
        blockers = servability.gguf_lora_blockers(servability.check(adapter))
        if blockers:
            raise RankwiseError(f"llama.cpp cannot apply this adapter: "
                                f"{'; '.join(f.reason for f in blockers)}; {MERGED_ROUTE}")
        if llama_cpp.fold_scales(peft_dir):
            echo("llama.cpp scales every pair by lora_alpha / r: rsLoRA / per-layer alphas folded into lora_B")
        llama_cpp.convert_lora(peft_dir, base, tmp / f"adapter-{outtype}.gguf", outtype, llama_cpp_dir)
        shutil.rmtree(peft_dir)
        if with_base:
            llama_cpp.convert_model(base, tmp / f"base-{outtype}.gguf", outtype, llama_cpp_dir)
    base_gguf = out / f"base-{outtype}.gguf" if with_base else "BASE.gguf"
    echo(f"apply it with: llama-cli -m {base_gguf} --lora {out / f'adapter-{outtype}.gguf'}")
    return out
