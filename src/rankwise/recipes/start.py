"""``model.adapter``: a run that starts from an existing adapter instead of a fresh one.

The usual SFT -> DPO pipeline: train a LoRA with SFT, then continue *that adapter* with DPO or
GRPO, without merging it into the base first. ``model.adapter`` names a PEFT LoRA folder
(``adapter_config.json`` + ``adapter_model.safetensors``), a rankwise adapter folder (an export,
``rankwise_adapter.json``) or a finished train run (its ``adapter/``). Its layers and weights
become the run's trainable adapter: the method, its ranks and targets are the adapter's (the run's
``method`` section is replaced by them, so ``config.yaml`` and the saved ``adapter/`` say what
trained), the first step starts at the adapter's logits, and ``adapter/`` holds the continued
adapter (on the same base, not a delta on top of the start).

DPO's and GRPO's reference is then, by default, the starting model, as TRL does for a PEFT model
that holds an adapter (``dpo.reference`` / ``grpo.reference``: ``initial``; ``adapters-off``
chooses the base instead; :mod:`rankwise.tasks.reference`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torch import nn

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.errors import RankwiseError
from rankwise.recipes import folders

RANKWISE = "rankwise_adapter.json"
READS = "model.adapter reads a PEFT LoRA folder, a rankwise adapter folder or a finished train run"


def locate(path: str | Path) -> tuple[str, Path]:
    """``("peft" | "rankwise", folder)`` of the adapter ``model.adapter`` names.

    Raises:
        RankwiseError: A missing folder, a run without ``adapter/`` (a full fine-tune, or not
            finished), or a folder holding something else.
    """
    path = Path(path).expanduser()
    found = folders.kind(path) if path.is_dir() else None
    if found == "train":
        if (path / "adapter" / RANKWISE).is_file():
            return "rankwise", path / "adapter"
        if (path / "model").is_dir():
            raise RankwiseError(f"model.adapter: {path} is a full fine-tune (its weights are "
                                f"{path / 'model'}); start from it with model.path: {path / 'model'}")
        raise RankwiseError(f"model.adapter: {path} has no adapter/ yet; let the run finish "
                            "(or --resume it)")
    if found == "adapter":
        return "rankwise", path
    if found in ("peft", "merge"):  # rankwise merge writes a PEFT folder (recorded as kind merge)
        return "peft", path
    what = folders.WHAT.get(found, "") if found else ("nothing" if path.is_dir() else "")
    if not what:
        raise RankwiseError(f"model.adapter: {path} not found; {READS}")
    raise RankwiseError(f"model.adapter: {path} holds {what}; {READS}")


def load_start(model: nn.Module, path: str | Path) -> Any:
    """Inject and load the starting adapter into ``model`` as adapter ``default`` (trainable).

    Args:
        model: The base model the adapter was trained on.
        path: ``model.adapter``.

    Returns:
        The method config of the adapter (rankwise files record theirs; a PEFT folder gives a
        ``lora`` config of its targets, rank, alpha, rsLoRA, DoRA, dropout and whole modules).

    Raises:
        RankwiseError: See :func:`locate`; a corrupt adapter, or one that does not fit ``model``.
    """
    kind, folder = locate(path)
    if kind == "rankwise":
        from rankwise.core.io import load_adapter
        meta = load_adapter(model, folder)
        method = dict(meta.get("method") or {})
        return from_dict(registry.get("method", str(method.get("name"))).config_cls, method, "method")
    peft = registry.get("exporter", "peft")  # the format's registered loader (the LoRA package's)
    return peft.loaded_config(model, peft.loader(model, folder))


def check_method(given: Any, start: Any, path: str) -> None:
    """Refuse method keys the run sets that differ from the starting adapter's.

    A key left at its default (or equal to the adapter's) is taken from the adapter; a run's own
    ``config.yaml`` (the adapter's method, written out) therefore passes.

    Raises:
        RankwiseError: Naming every differing key.
    """
    default = from_dict(type(given), {"name": given.name}, "method")
    diff = []
    if given.name not in ("lora", start.name):  # lora: build_run_config's default name
        diff.append(f"method.name ({given.name!r} here, {start.name!r} in the adapter)")
    for f in dataclasses.fields(given):
        mine = getattr(given, f.name)
        if f.name == "name" or mine == getattr(default, f.name):
            continue
        theirs = getattr(start, f.name, dataclasses.MISSING)
        if mine != theirs:
            shown = "no such key" if theirs is dataclasses.MISSING else repr(theirs)
            diff.append(f"method.{f.name} ({mine!r} here, {shown} in the adapter)")
    if diff:
        raise RankwiseError(f"model.adapter {path} sets the method, and the config differs from it "
                            f"in {', '.join(diff)}; remove those keys (the adapter's method, ranks and "
                            "targets continue)")


__all__ = ["locate", "load_start", "check_method"]
