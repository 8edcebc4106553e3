"""Crash-safe checkpoints: trainable weights, the engine's state (optimizer, scheduler,
gradient scaler, RNG), and the adapter's structure (so a resume rebuilds the layers exactly,
without repeating a data-driven initialisation such as GoRA's).

Each checkpoint is a folder ``checkpoints/step-NNNNNNN`` written under a temporary name and
renamed, so a kill at any moment leaves the previous checkpoints intact. Weights are
safetensors; optimizer/scheduler/RNG state is loaded with ``torch.load(weights_only=True)``,
which never runs pickled code.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from rankwise.core import atomic
from rankwise.errors import RankwiseError

PREFIX = "step-"
FILES = ("trainable.safetensors", "state.pt", "meta.json")  # what a complete checkpoint holds


def _frozen_adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' frozen saved tensors (``core.ops.adapter_buffers``: a residual LoRA init's
    ``A0, B0``), by their ``named_buffers`` name."""
    from rankwise.core.ops import adapter_buffers, adapter_names
    ids = {id(b) for n in adapter_names(model) for b in adapter_buffers(model, n).values()}
    return {n: b for n, b in model.named_buffers() if id(b) in ids}


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return clones of every parameter that requires grad (and of the adapters' frozen saved
    tensors), by name."""
    out = {n: p.detach().clone().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    out.update({n: b.detach().clone().contiguous() for n, b in _frozen_adapter_tensors(model).items()})
    return out


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, state: dict, keep: int = 2,
                    meta: dict | None = None) -> Path:
    """Write checkpoint ``step`` atomically and keep the newest ``keep``.

    Args:
        run_dir: The run folder.
        step: Optimizer steps done.
        model: Its trainable parameters are saved (safetensors).
        state: The engine's :meth:`~rankwise.engine.loop.Engine.state_dict`.
        keep: Checkpoints kept.
        meta: JSON metadata (``train_time_s``, the adapter ``structure``...).

    Returns:
        The checkpoint folder.
    """
    folder = Path(run_dir) / "checkpoints" / f"{PREFIX}{step:07d}"
    # Data order is a pure function of (seed, step); torch's RNG covers dropout and sampling.
    with atomic.folder(folder) as tmp:
        save_file(trainable_state(model), str(tmp / "trainable.safetensors"))
        torch.save(state, tmp / "state.pt")  # tensors and plain containers only
        atomic.write_json(tmp / "meta.json", {**(meta or {}), "step": step})
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        _remove(old)
    return folder


def _remove(folder: Path) -> None:
    """Delete a checkpoint folder: renamed out of the ``step-*`` namespace first, so a kill in
    the middle of the deletion leaves a ``.step-*.old`` folder for :func:`clean_incomplete`,
    never a ``step-*`` folder that holds only part of a checkpoint."""
    trash = folder.with_name(f".{folder.name}.old")
    shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(folder, trash)
    except OSError:
        trash = folder
    shutil.rmtree(trash, ignore_errors=True)


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in FILES)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Return complete checkpoint folders (each of :data:`FILES` present), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(PREFIX) and _complete(p))


def clean_incomplete(run_dir: Path) -> list[Path]:
    """Delete what a kill left half-done in ``run_dir/checkpoints``: ``step-*`` folders that lack
    one of :data:`FILES` (a kill during rotation, before :func:`_remove` renamed first), and the
    hidden ``.step-*`` folders of an interrupted write or deletion. Complete checkpoints, and
    anything else in the folder, are left alone; resuming from the newest stays exact.

    Args:
        run_dir: The run folder.

    Returns:
        The ``step-*`` folders removed (hidden leftovers are removed silently).
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        if not p.is_dir():
            continue
        if p.name.startswith(f".{PREFIX}") and p.name.endswith((".tmp", ".old")):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(PREFIX) and not _complete(p):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def read_meta(path: Path) -> dict:
    """The ``meta.json`` of a checkpoint (``step``, ``structure``, ...).

    Raises:
        RankwiseError: If it is missing or corrupt.
    """
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
        int(meta["step"])
        return meta
    except Exception as err:  # noqa: BLE001 - any corruption is the same user-facing problem
        raise RankwiseError(f"checkpoint {path} is corrupt ({type(err).__name__}); delete it to "
                            "resume from the previous one") from None


def load_checkpoint(path: Path, model: nn.Module, engine) -> dict:
    """Restore a checkpoint into the model and the engine; return its meta.

    Raises:
        RankwiseError: If the checkpoint is corrupt or does not fit the model.
    """
    meta = read_meta(path)
    try:
        weights = load_file(str(path / "trainable.safetensors"))
        state = torch.load(path / "state.pt", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any corruption is the same user-facing problem
        raise RankwiseError(f"checkpoint {path} is corrupt ({type(err).__name__}); delete it to "
                            "resume from the previous one") from None
    params = {**dict(model.named_parameters()), **_frozen_adapter_tensors(model)}
    missing = [k for k, p in params.items() if p.requires_grad and k not in weights]
    wrong = [k for k, v in weights.items() if k in params and tuple(params[k].shape) != tuple(v.shape)]
    if missing or wrong or any(k not in params for k in weights):
        detail = f" ({wrong[0]!r} has shape {tuple(weights[wrong[0]].shape)}, the model's is " \
                 f"{tuple(params[wrong[0]].shape)})" if wrong else ""
        raise RankwiseError(f"checkpoint {path} does not match this run's model/method{detail}; "
                            "resume with the run's own config.yaml")
    with torch.no_grad():
        for k, v in weights.items():
            params[k].copy_(v)
    engine.load_state_dict(state)
    return meta
