"""Operations on a model's adapters, all through the :class:`AdapterModule` protocol.

Besides adapter layers, a model may have *modules to save*: whole base modules (a new
classification head) that train and are saved with the adapter, as in PEFT's
``modules_to_save``. Their paths are recorded on the model by :func:`set_modules_to_save`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from rankwise.core.inject import replace_module
from rankwise.core.protocol import adapter_modules, is_mergeable
from rankwise.errors import RankwiseError

_SAVE_ATTR = "_rankwise_modules_to_save"


def set_modules_to_save(model: nn.Module, paths: list[str]) -> None:
    """Record whole modules that train and are saved alongside the adapters.

    Args:
        model: The adapted model.
        paths: Module paths (e.g. ``["classifier"]``); missing paths raise.

    Raises:
        RankwiseError: If a path is not a module of ``model``.
    """
    names = dict(model.named_modules())
    missing = [p for p in paths if p not in names]
    if missing:
        raise RankwiseError(f"modules_to_save {missing} not found in the model; "
                            f"top-level modules: {[n for n, _ in model.named_children()]}")
    object.__setattr__(model, _SAVE_ATTR, list(dict.fromkeys(paths)))


def modules_to_save(model: nn.Module) -> list[str]:
    """Return the paths recorded by :func:`set_modules_to_save` (empty if none)."""
    return list(getattr(model, _SAVE_ATTR, []))


def adapter_names(model: nn.Module) -> list[str]:
    """Return every adapter name present in the model, in first-seen order."""
    seen: dict[str, None] = {}
    for _, mod in adapter_modules(model):
        for n in mod.adapter_names():
            seen[n] = None
    return list(seen)


def adapter_state_dict(model: nn.Module, name: str = "default",
                       include_modules_to_save: bool = True) -> dict[str, torch.Tensor]:
    """Return adapter ``name``'s tensors keyed by ``<module path>.<layer key>``.

    Args:
        model: The adapted model.
        name: The adapter name.
        include_modules_to_save: Also include the recorded whole modules' tensors.

    Returns:
        A dict of detached tensors (shared storage).
    """
    out: dict[str, torch.Tensor] = {}
    for path, mod in adapter_modules(model):
        if name in mod.adapter_names():
            for key, p in mod.adapter_params(name).items():
                out[f"{path}.{key}"] = p.detach()
    out.update({k: b.detach() for k, b in adapter_buffers(model, name).items()})
    if include_modules_to_save:
        for path in modules_to_save(model):
            for key, p in model.get_submodule(path).named_parameters():
                out[f"{path}.{key}"] = p.detach()
    return out


def adapter_parameters(model: nn.Module, name: str = "default") -> dict[str, nn.Parameter]:
    """Like :func:`adapter_state_dict` but returns the live parameters."""
    out: dict[str, nn.Parameter] = {}
    for path, mod in adapter_modules(model):
        if name in mod.adapter_names():
            for key, p in mod.adapter_params(name).items():
                out[f"{path}.{key}"] = p
    for path in modules_to_save(model):
        for key, p in model.get_submodule(path).named_parameters():
            out[f"{path}.{key}"] = p
    return out


def adapter_buffers(model: nn.Module, name: str = "default") -> dict[str, torch.Tensor]:
    """Frozen tensors that belong to adapter ``name`` and are saved with it but never train
    (a layer's optional ``adapter_buffers(name)``: e.g. the initial factors of a LoRA init that
    moved part of the base into the adapter), keyed like :func:`adapter_state_dict`."""
    out: dict[str, torch.Tensor] = {}
    for path, mod in adapter_modules(model):
        get = getattr(mod, "adapter_buffers", None)
        if get is not None and name in mod.adapter_names():
            out.update({f"{path}.{key}": b for key, b in get(name).items()})
    return out


def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor],
                            name: str = "default", strict: bool = True) -> None:
    """Copy ``state`` (as produced by :func:`adapter_state_dict`) into the model.

    Args:
        model: A model with adapter ``name`` already injected with matching shapes.
        state: Tensors keyed by ``<module path>.<layer key>``.
        name: The adapter to load into.
        strict: Require exactly the same keys.

    Raises:
        RankwiseError: On missing/unexpected keys or shape mismatches (message names them).
    """
    params = {**adapter_parameters(model, name), **adapter_buffers(model, name)}
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if strict and (missing or unexpected):
        raise RankwiseError(
            f"adapter file does not fit this model: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}; load it onto the base model and method it was trained with"
        )
    with torch.no_grad():
        for key, value in state.items():
            if key not in params:
                continue
            p = params[key]
            if p.shape != value.shape:
                raise RankwiseError(f"adapter tensor {key!r} has shape {tuple(value.shape)}, "
                                    f"the model expects {tuple(p.shape)}")
            p.copy_(value.to(p.dtype))


def mark_trainable(model: nn.Module, name: str = "default") -> None:
    """Freeze everything, then unfreeze adapter ``name`` and the modules to save."""
    for p in model.parameters():
        p.requires_grad_(False)
    for p in adapter_parameters(model, name).values():
        p.requires_grad_(True)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """Return ``(trainable, total)`` parameter counts (shared tensors counted once; a
    quantized weight counts its logical ``out * in`` entries, not its packed bytes)."""
    from rankwise.core.weights import quantized_numel
    logical = quantized_numel(model)
    seen: set[int] = set()
    trainable = total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += logical.get(id(p), p.numel())
        if p.requires_grad:
            trainable += p.numel()
    return trainable, total


def set_adapter(model: nn.Module, name: str) -> None:
    """Make ``name`` the only active adapter in every layer that has it.

    Raises:
        RankwiseError: If no layer has an adapter with that name.
    """
    names = adapter_names(model)
    if name not in names:
        raise RankwiseError(f"no adapter named {name!r}; adapters here: {names}")
    for _, mod in adapter_modules(model):
        mod.set_active([name] if name in mod.adapter_names() else [])


def delete_adapter(model: nn.Module, name: str) -> None:
    """Remove adapter ``name`` from every layer."""
    for _, mod in adapter_modules(model):
        if name in mod.adapter_names():
            mod.delete(name)


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Context manager: inside it the model computes the base model's output.

    Merged adapters are unmerged on entry (and stay unmerged).
    """
    mods = [m for _, m in adapter_modules(model)]
    saved = [m.active_names() for m in mods]
    for m in mods:
        m.unmerge()
        m.set_active([])
    try:
        yield
    finally:
        for m, names in zip(mods, saved):
            m.set_active(names)


def check_mergeable(model: nn.Module) -> None:
    """Raise if any adapter layer cannot be merged into its base weight.

    Raises:
        RankwiseError: Naming the first such layer and what to use instead.
    """
    for path, mod in adapter_modules(model):
        if not is_mergeable(mod):
            reason = getattr(mod, "unmergeable_reason", None) or (
                "its output depends on the input, e.g. a router; keep it as an adapter: "
                "export with --format rankwise")
            raise RankwiseError(f"adapter layer {path!r} ({type(mod).__name__}) cannot be merged "
                                f"into the base weights ({reason})")


def merge_adapters(model: nn.Module, name: str | None = None) -> None:
    """Merge the active adapters (or ``name``) into the base weights, reversibly.

    Raises:
        RankwiseError: If an adapter layer is not mergeable (nothing is changed then).
    """
    check_mergeable(model)
    for _, mod in adapter_modules(model):
        for n in ([name] if name else mod.active_names()):
            if n in mod.adapter_names():
                mod.merge(n)


def unmerge_adapters(model: nn.Module) -> None:
    """Undo :func:`merge_adapters` in every layer."""
    for _, mod in adapter_modules(model):
        mod.unmerge()


def merge_and_unload(model: nn.Module, name: str | None = None) -> nn.Module:
    """Merge and replace every adapter layer by its base layer; returns the plain model."""
    merge_adapters(model, name)
    for path, mod in list(adapter_modules(model)):
        replace_module(model, path, mod.base_layer)
    if hasattr(model, _SAVE_ATTR):
        object.__delattr__(model, _SAVE_ATTR)
    return model
