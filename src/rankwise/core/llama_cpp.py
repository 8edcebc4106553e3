"""llama.cpp's own converters, found and run: ``convert_hf_to_gguf.py`` (a transformers model
folder -> one GGUF file) and ``convert_lora_to_gguf.py`` (a PEFT LoRA folder -> a LoRA GGUF that
``llama-cli -m BASE.gguf --lora ADAPTER.gguf`` applies).

rankwise never rewrites the conversion: the scripts run unchanged, in a subprocess with this
Python (they need torch, numpy, transformers and ``sentencepiece``, all rankwise dependencies or
its ``gguf`` extra), and import the ``gguf`` package that sits beside them (``gguf-py``), so
the writer always matches the converter. They are not on PyPI as a package; two ways to have
them, both a plain folder holding the two scripts, ``conversion/`` and ``gguf-py/``:

* a llama.cpp checkout (its root folder);
* :func:`fetch` (``python -m rankwise.core.llama_cpp DEST``): ``pip download`` the
  llama-cpp-python source distribution, which vendors llama.cpp, and unpack only those files
  (MIT, with llama.cpp's LICENSE). ``make setup`` does this into ``.venv/llama.cpp`` so tests find it.

:func:`find` looks at the path given (``--llama-cpp DIR``), then ``$RANKWISE_LLAMA_CPP``, then
``<sys.prefix>/llama.cpp``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from rankwise.errors import RankwiseError

ENV = "RANKWISE_LLAMA_CPP"
PINNED = "0.3.36"  # llama-cpp-python whose vendored llama.cpp rankwise is tested with (gguf-py 0.19.0)
MODEL_SCRIPT, LORA_SCRIPT = "convert_hf_to_gguf.py", "convert_lora_to_gguf.py"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # the types both converters write (q8_0: llama.cpp's Q8_0)
NEEDED = (MODEL_SCRIPT, LORA_SCRIPT, "gguf-py")
_UNPACK = (MODEL_SCRIPT, LORA_SCRIPT, "conversion/", "gguf-py/", "LICENSE")


def _has_scripts(folder: Path) -> bool:
    return all((folder / n).exists() for n in NEEDED)


def find(path: str | Path | None = None) -> Path:
    """The folder holding llama.cpp's converters.

    Args:
        path: ``--llama-cpp DIR`` (a llama.cpp checkout or a :func:`fetch` folder); default:
            ``$RANKWISE_LLAMA_CPP``, then ``<sys.prefix>/llama.cpp``.

    Returns:
        The folder.

    Raises:
        RankwiseError: Where none holds the converters (one line naming how to get them).
    """
    how = (f"pass --llama-cpp DIR (a llama.cpp checkout), or fetch the converters once with "
           f"'python -m rankwise.core.llama_cpp {Path(sys.prefix) / 'llama.cpp'}'")
    if path is not None:
        if not _has_scripts(Path(path)):
            raise RankwiseError(f"--llama-cpp {path}: no {MODEL_SCRIPT} / {LORA_SCRIPT} / gguf-py "
                                f"there; {how}")
        return Path(path)
    for cand in (os.environ.get(ENV), Path(sys.prefix) / "llama.cpp"):
        if cand and _has_scripts(Path(cand)):
            return Path(cand)
    raise RankwiseError(f"GGUF export needs llama.cpp's converters ({MODEL_SCRIPT}, "
                        f"{LORA_SCRIPT}); {how} (or set ${ENV})")


def fetch(dest: str | Path, version: str = PINNED) -> Path:
    """Unpack llama.cpp's converters from llama-cpp-python's source distribution into ``dest``.

    Runs ``pip download --no-deps --no-binary :all: llama-cpp-python==VERSION`` (a package index
    is needed once) and extracts only the converter files of its ``vendor/llama.cpp``.

    Raises:
        RankwiseError: If pip fails or the archive lacks the converters.
    """
    dest = Path(dest)
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                               "--no-binary", ":all:", f"llama-cpp-python=={version}", "-d", tmp],
                              capture_output=True, text=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if done.returncode != 0 or not archives:
            last = (done.stderr.strip().splitlines() or ["no archive"])[-1]
            raise RankwiseError(f"pip could not download llama-cpp-python=={version} ({last}); "
                                "pass --llama-cpp DIR (a llama.cpp checkout) instead")
        with tarfile.open(archives[0]) as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name.split("/vendor/llama.cpp/", 1)[-1] if "/vendor/llama.cpp/" in m.name else None
                if rel and (m.isfile() or m.isdir()) and any(rel == u or rel.startswith(u) for u in _UNPACK):
                    m.name = rel
                    members.append(m)
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(dest, members=members, **safe)
    if not _has_scripts(dest):
        raise RankwiseError(f"llama-cpp-python=={version} holds no llama.cpp converters")
    return dest


def _run(script: Path, args: list[str], what: str) -> None:
    """Run a converter; its failure becomes one line with its own last error."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("NO_LOCAL_GGUF", None)  # the gguf-py beside the script, the writer it was made with
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env)
    if done.returncode == 0:
        return
    lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"(ERROR|CRITICAL)|\w*(Error|Exception)\b", ln)]
    last = (errors or lines or ["no output"])[-1]
    last = re.sub(r"^(ERROR|CRITICAL):[\w.-]+:", "", last).strip()
    unsupported = re.search(r"Model (\S+) is not supported", "\n".join(lines))
    if unsupported:
        raise RankwiseError(f"llama.cpp's converter does not support the architecture "
                            f"{unsupported[1]}; export --format merged (transformers) instead")
    raise RankwiseError(f"llama.cpp's {script.name} failed on {what}: {last}")


def check_outtype(outtype: str) -> None:
    """Raises: RankwiseError: ``outtype`` is not one of :data:`OUTTYPES`."""
    if outtype not in OUTTYPES:
        raise RankwiseError(f"--outtype {outtype!r}: expected one of {', '.join(OUTTYPES)}")


def convert_model(model_dir: str | Path, out_file: str | Path, outtype: str = "f16",
                  llama_cpp: str | Path | None = None) -> Path:
    """``convert_hf_to_gguf.py MODEL_DIR --outfile OUT --outtype TYPE``.

    Args:
        model_dir: A transformers model folder with its tokenizer files.
        out_file: The GGUF file to write.
        outtype: One of :data:`OUTTYPES`.
        llama_cpp: The converters' folder (see :func:`find`).

    Returns:
        ``out_file``.

    Raises:
        RankwiseError: No converter, an architecture it does not support, or its failure.
    """
    check_outtype(outtype)
    script = find(llama_cpp) / MODEL_SCRIPT
    _run(script, [str(model_dir), "--outfile", str(out_file), "--outtype", outtype], str(model_dir))
    return Path(out_file)


def convert_lora(peft_dir: str | Path, base_dir: str | Path, out_file: str | Path,
                 outtype: str = "f16", llama_cpp: str | Path | None = None) -> Path:
    """``convert_lora_to_gguf.py PEFT_DIR --base BASE_DIR --outfile OUT --outtype TYPE``.

    Args:
        peft_dir: A PEFT LoRA folder llama.cpp can apply (see :mod:`rankwise.core.servability`).
        base_dir: The base model's folder (its ``config.json`` names the architecture).
        out_file: The LoRA GGUF file to write.
        outtype: One of :data:`OUTTYPES`.
        llama_cpp: The converters' folder (see :func:`find`).

    Returns:
        ``out_file``.

    Raises:
        RankwiseError: As :func:`convert_model`.
    """
    check_outtype(outtype)
    script = find(llama_cpp) / LORA_SCRIPT
    _run(script, [str(peft_dir), "--base", str(base_dir), "--outfile", str(out_file),
                  "--outtype", outtype], str(peft_dir))
    return Path(out_file)


def _alpha(path: str, pattern: dict, default: float) -> float:
    """PEFT's ``alpha_pattern`` rule: the first key with ``(.*\\.)?(key)$`` matching ``path``."""
    return next((float(v) for k, v in pattern.items() if re.match(rf"(.*\.)?({k})$", path)), float(default))


def fold_scales(peft_dir: str | Path) -> int:
    """Rewrite a PEFT LoRA folder (in place) so llama.cpp's one rule, scale ``lora_alpha / r`` per
    pair (``llama_adapter_lora_weight::get_scale``), gives PEFT's scale for every layer: each
    ``lora_B`` whose PEFT scale ``s`` (``alpha_pattern``, rsLoRA's ``alpha / sqrt(r)``) differs
    is multiplied by ``s / (lora_alpha / r)``, and ``use_rslora`` / ``alpha_pattern`` are dropped.
    ``B A`` times the scale, the weight change, is unchanged up to rounding.

    Returns:
        The number of ``lora_B`` tensors rescaled.
    """
    import json

    from safetensors.torch import load_file, save_file
    peft_dir = Path(peft_dir)
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    rslora, pattern = bool(cfg.get("use_rslora")), dict(cfg.get("alpha_pattern") or {})
    if not rslora and not pattern:
        return 0
    alpha0 = float(cfg["lora_alpha"])
    tensors = load_file(str(peft_dir / "adapter_model.safetensors"))
    changed = 0
    for key in [k for k in tensors if k.endswith(".lora_B.weight")]:
        path = key[: -len(".lora_B.weight")].removeprefix("base_model.model.")
        r = tensors[key].shape[1]  # (out, r)
        alpha = _alpha(path, pattern, alpha0)
        ratio = (alpha / r ** 0.5 if rslora else alpha / r) / (alpha0 / r)
        if ratio != 1.0:
            b = tensors[key]
            tensors[key] = (b.double() * ratio).to(b.dtype).contiguous()
            changed += 1
    cfg.update(use_rslora=False, alpha_pattern={})
    save_file(tensors, str(peft_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (peft_dir / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return changed


if __name__ == "__main__":  # python -m rankwise.core.llama_cpp DEST
    if len(sys.argv) != 2:
        sys.exit("usage: python -m rankwise.core.llama_cpp DEST")
    try:
        print(f"wrote llama.cpp's converters to {fetch(sys.argv[1])}")
    except RankwiseError as err:
        sys.exit(str(err))
