"""``rankwise obfuscate``: publish a model folder under rank-d additive masks (LoRO-like), the
factors kept apart. The mask falls to a rank-d SVD of ``W' − W_pretrained`` (``bench loro``), so it
is named "LoRO-like", not LoRO, until the paper's construction is recovered (docs/loro.md).

Reads a transformers model folder, adds a multiplexed low-rank mask to every targeted linear
layer (:mod:`rankwise.obfuscation`) and writes

* ``DIR/``: the published model (``save_pretrained``, safetensors, float32) with the source
  folder's tokenizer and other non-weight files, and ``obfuscation.json`` (rank, layers and the
  trusted side's bytes against the model's; nothing secret);
* the factors file (default ``DIR.factors.safetensors`` beside ``DIR``; never inside it).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from rankwise import configs
from rankwise.core import atomic
from rankwise.errors import RankwiseError
from rankwise.obfuscation import ObfuscateConfig, memory_report, obfuscate, save_factors

REPORT = "obfuscation.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".onnx", ".index.json")


def default_factors_path(out: Path) -> Path:
    """``DIR.factors.safetensors`` beside the published folder ``DIR``."""
    return out.parent / f"{out.name}.factors.safetensors"


def check_paths(model_dir: Path, out: Path, factors: Path) -> None:
    """Refuse a source that is no model folder, a non-empty ``--out`` and factors inside it.

    Raises:
        RankwiseError: One line naming the fix.
    """
    if not model_dir.is_dir() or not (model_dir / "config.json").is_file():
        raise RankwiseError(f"MODEL {model_dir} is not a model folder (no config.json); pass a folder "
                            "written by save_pretrained")
    atomic.check_folder(out)
    if out.is_dir() and any(out.iterdir()):
        raise RankwiseError(f"--out {out} is not empty; choose a new folder for the published model")
    if factors.resolve().is_relative_to(out.resolve()):
        raise RankwiseError(f"--factors {factors} lies inside the published folder {out}; keep the "
                            f"factors outside it (default {default_factors_path(out)})")
    if factors.exists():
        raise RankwiseError(f"--factors {factors} exists; choose another path (the old factors are "
                            "the only key to the model they were written for)")
    if factors.resolve().is_relative_to(model_dir.resolve()) or out.resolve() == model_dir.resolve():
        raise RankwiseError(f"--out and --factors must lie outside MODEL {model_dir}; choose other paths")


def load_folder_model(model_dir: Path):
    """The model in ``model_dir`` as its saved architecture (``config.architectures[0]``), float32."""
    import torch
    import transformers
    from transformers import logging as hf_logging

    from rankwise.recipes.model import dtype_kwargs
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    arch = (json.loads((model_dir / "config.json").read_text()).get("architectures") or ["AutoModel"])[0]
    cls = getattr(transformers, arch, transformers.AutoModel)
    try:
        return cls.from_pretrained(str(model_dir), local_files_only=True, **dtype_kwargs(torch.float32)).eval()
    except (OSError, ValueError, KeyError) as err:
        raise RankwiseError(f"MODEL {model_dir}: cannot load it with transformers "
                            f"({str(err).splitlines()[0]}); pass a folder written by save_pretrained") from None


def run_obfuscate(model_dir: Path, out: Path, config: ObfuscateConfig, factors: Path | None = None) -> dict:
    """Publish ``model_dir`` obfuscated into ``out`` and write the factors to ``factors``.

    Args:
        model_dir: A transformers model folder (``demo``: the packaged MiniLM).
        out: The published folder (new or empty).
        config: Rank, cornerstones, scale, seed.
        factors: The factors file (default :func:`default_factors_path`).

    Returns:
        The report written to ``out/obfuscation.json``.

    Raises:
        RankwiseError: Bad paths, settings, or a rank not below a layer's width.
    """
    from rankwise.recipes.model import model_folder
    if str(model_dir) == "demo":
        model_dir = model_folder("demo")
    model_dir, out = Path(model_dir), Path(out)
    factors = Path(factors) if factors is not None else default_factors_path(out)
    if problems := configs.problems_of(config):
        raise RankwiseError("; ".join(problems))
    check_paths(model_dir, out, factors)
    model = load_folder_model(model_dir)
    keys = obfuscate(model, config)
    report = {**memory_report(model, keys), "mask_scale": config.mask_scale, "source": str(model_dir),
              "masked_layers": sorted(keys.shapes)}
    with atomic.folder(out) as tmp:
        for src in model_dir.iterdir():  # tokenizer and configs; never the source weights
            if src.is_file() and not src.name.endswith(WEIGHT_SUFFIXES) and src.name != "config.json":
                shutil.copy2(src, tmp / src.name)
        model.save_pretrained(str(tmp), safe_serialization=True)
        atomic.write_json(tmp / REPORT, report)
        save_factors(keys, factors, config)
    return {**report, "factors_path": str(factors), "out": str(out)}
