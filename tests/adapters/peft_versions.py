"""The PEFT versions the matrix (``test_peft_versions.py``) loads rankwise's exports with, each
paired with the transformers of its time, and how they are fetched.

Each older version lives in its own folder, ``<venv>/peft-versions/<peft version>/``, made by
``pip install --no-deps --target`` from wheels on PyPI (never into the venv itself); a process
that puts that folder first on ``sys.path`` imports that peft and transformers, and torch,
numpy and safetensors from the venv. The newest version is the venv's own peft.
``make setup`` runs ``python tests/adapters/peft_versions.py`` (best effort: without a package
index the matrix's old versions skip, naming ``make setup``); tests never download.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ENV = "RANKWISE_PEFT_VERSIONS"  # another place for the folders (default: <venv>/peft-versions)
# peft version -> the wheels installed beside it (a transformers of its time that imports with
# it on torch 2.13 / Python 3.11, and the tokenizers / huggingface_hub / accelerate it asks for)
PINS: dict[str, tuple[str, ...]] = {
    "0.13.2": ("transformers==4.46.3", "tokenizers==0.20.3", "huggingface_hub==0.26.5",
               "accelerate==1.0.1"),
    "0.14.0": ("transformers==4.47.1", "tokenizers==0.21.0", "huggingface_hub==0.27.0",
               "accelerate==1.2.1"),
    "0.15.2": ("transformers==4.51.3", "tokenizers==0.21.1", "huggingface_hub==0.30.2",
               "accelerate==1.6.0"),
    "0.16.0": ("transformers==4.53.3", "tokenizers==0.21.1", "huggingface_hub==0.33.4",
               "accelerate==1.8.1"),
    "0.17.1": ("transformers==4.56.2", "tokenizers==0.22.1", "huggingface_hub==0.35.3",
               "accelerate==1.10.1"),
    "0.18.1": ("transformers==4.57.6", "tokenizers==0.22.1", "huggingface_hub==0.36.0",
               "accelerate==1.11.0"),
}


def root() -> Path:
    """The folder holding one subfolder per fetched version."""
    return Path(os.environ.get(ENV) or Path(sys.prefix) / "peft-versions")


def site(version: str) -> Path:
    """The ``--target`` folder of ``version`` (it exists once fetched)."""
    return root() / version


def fetch(version: str) -> Path:
    """Download ``version``'s wheels and install them into :func:`site` (replaced atomically).

    Raises:
        subprocess.CalledProcessError: When pip cannot download or install them.
    """
    dest = site(version)
    if (dest / "peft").is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        wheels, target = Path(tmp) / "wheels", Path(tmp) / "site"
        subprocess.run([*pip, "download", "--no-deps", "--only-binary", ":all:", "-d", str(wheels),
                        f"peft=={version}", *PINS[version]], check=True)
        subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(target),
                        *map(str, sorted(wheels.glob("*.whl")))], check=True)
        shutil.rmtree(target / "bin", ignore_errors=True)
        target.rename(dest)
    return dest


if __name__ == "__main__":  # python tests/adapters/peft_versions.py [VERSION ...]
    failed = []
    for v in sys.argv[1:] or list(PINS):
        try:
            print(f"peft {v} + {', '.join(PINS[v])} -> {fetch(v)}")
        except subprocess.CalledProcessError as err:
            failed.append(v)
            print(f"peft {v}: {err}", file=sys.stderr)
    sys.exit(1 if failed else 0)
