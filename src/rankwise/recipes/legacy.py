"""The task's old spelling, read for one release: ``model.task`` plus a side section.

Until the ``task:`` section, ``model.task: dpo`` chose the task and a top-level ``dpo:``
(``grpo:``, ``memory_decoder:``) held its settings. Now one section is both, built from the
registered task's config class as ``method:`` is: ``task: {name: dpo, beta: 0.1}``.
:func:`translate` turns the old spelling into the new one before a config is validated, with a
one-line notice naming the new spelling (:func:`notice` prints it once per process);
:func:`old_shape` turns a resolved config back into the old layout, so the hash of a comparison
run recorded before the change (``rankwise.recipes.runs.config_hash``) still matches.

Likewise ``compress.kv_cache: {kind: nsnquant, bits: 2}``, from before the KV caches were
registry entries, reads as ``{name: nsnquant, bits: 2}`` (``kind: none`` as ``null``), with its
notice (:func:`kv_cache_spelling`).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import NamedTuple

import yaml

# the old side sections and the task each one went with
SECTION_TASKS = {"dpo": "dpo", "grpo": "grpo", "memory_decoder": "memory-decoder"}
_SHOWN: set[str] = set()  # notices printed by this process


class Spelling(NamedTuple):
    """A raw config in the new spelling.

    Attributes:
        data: The raw config with a ``task:`` section and no ``model.task`` or side section.
        notice: The one-line notice for the old spelling (``None``: it was the new one).
        problems: What cannot be translated (a side section of another task, both spellings).
        where: The prefix of the task section's messages (``task``, or the side section the
            user wrote).
        name_key: Where the task's name was written (``task.name`` or ``model.task``).
    """

    data: dict
    notice: str | None = None
    problems: tuple[str, ...] | list[str] = ()
    where: str = "task"
    name_key: str = "task.name"


def translate(data: dict) -> Spelling:
    """The new spelling of ``data`` (a raw run config; not changed).

    Args:
        data: The raw config (YAML file and ``--set`` overrides).

    Returns:
        The :class:`Spelling`: ``data`` itself when it has no old key.
    """
    model = data.get("model")
    has_name = isinstance(model, dict) and "task" in model
    sides = [s for s in SECTION_TASKS if s in data]  # an empty one (dpo: null) is as good as none
    if not has_name and not sides:
        return Spelling(data)
    parts = (["model.task"] if has_name else []) + [f"the {s}: section" for s in sides]
    old = f"{' and '.join(parts)} {'is' if len(parts) == 1 else 'are'} the old spelling"
    new = {k: v for k, v in data.items() if k not in SECTION_TASKS}
    if has_name:
        new["model"] = {k: v for k, v in model.items() if k != "task"}
    if "task" in data:
        return Spelling(new, problems=[f"{old} of the task: section, which this config also has; "
                                       "move its keys into task: (task.name, task.<key>)"])
    name = model["task"] if has_name else "classification"  # the old default task
    task, problems, where = {"name": name}, [], "task"
    for side in sides:
        value = data[side]
        if value is None:
            continue
        if SECTION_TASKS[side] != name:
            problems.append(f"the {side} section needs model.task: {SECTION_TASKS[side]} (got {name}); "
                            "remove it or change the task")
        elif not isinstance(value, dict):
            problems.append(f"{side}: expected a mapping, got {value!r}")
        else:
            task, where = {**value, "name": name}, side
    new["task"] = {"name": name, **{k: v for k, v in task.items() if k != "name"}}
    return Spelling(new, f"notice: {old}, read until the next release; write "
                         f"{_flow(new['task'], where)}", problems, where,
                    "model.task" if has_name else "task.name")


def kv_cache_spelling(data: dict) -> tuple[dict, str | None]:
    """``compress.kv_cache`` in the new spelling: ``kind`` becomes ``name``; ``kind: none``
    becomes ``null``; keys the named cache does not have (``fp``'s ``bits``, which the old
    spelling ignored) are left out.

    Args:
        data: The raw config (not changed).

    Returns:
        ``(data in the new spelling, the one-line notice or None)``.
    """
    from rankwise import registry
    compress = data.get("compress")
    kv = compress.get("kv_cache") if isinstance(compress, dict) else None
    if not isinstance(kv, dict) or "kind" not in kv or "name" in kv:
        return data, None
    name = kv["kind"]
    new: dict | None = None
    if name != "none":
        new = {"name": name, **{k: v for k, v in kv.items() if k != "kind"}}
        if name in registry.names("kv-cache"):
            keys = {f.name for f in dataclasses.fields(registry.get("kv-cache", name).config_cls)}
            new = {k: v for k, v in new.items() if k in keys}
    text = "null (or leave it out)" if new is None else yaml.safe_dump(
        new, default_flow_style=True, sort_keys=False, width=10**6).strip()
    return ({**data, "compress": {**compress, "kv_cache": new}},
            f"notice: compress.kv_cache.kind is the old spelling, read until the next release; "
            f"write compress.kv_cache: {text}")


def _flow(task: dict, side: str) -> str:
    """``task: {name: dpo, beta: 0.2}`` (its keys elided past one short line)."""
    text = "task: " + yaml.safe_dump(task, default_flow_style=True, sort_keys=False, width=10**6).strip()
    if len(text) <= 100:
        return text
    return f"task: {{name: {task['name']}, ...}} with the keys of the {side}: section"


def notice(text: str | None) -> None:
    """Print ``text`` on stderr, once per process (and, under torchrun, on rank 0 only)."""
    if text is None or text in _SHOWN or os.environ.get("RANK", "0") != "0":
        return
    _SHOWN.add(text)
    print(text, file=sys.stderr)


def old_shape(resolved: dict) -> dict:
    """A resolved config (``RunConfig.to_dict()``) in the layout before the ``task:`` section:
    ``model.task`` and, for the tasks that had one, the side section (the other tasks keep a
    ``task:`` section of their settings, if any).

    Args:
        resolved: The resolved config as plain data.

    Returns:
        A new mapping; ``resolved`` is not changed.
    """
    task = resolved.get("task")
    if not isinstance(task, dict):
        return resolved
    out = {k: v for k, v in resolved.items() if k != "task"}
    out["model"] = {**(out.get("model") or {}), "task": task.get("name")}
    rest = {k: v for k, v in task.items() if k != "name"}
    side = next((s for s, t in SECTION_TASKS.items() if t == task.get("name")), None)
    if side is not None:
        out[side] = rest
    elif rest:
        out["task"] = rest
    return out


__all__ = ["SECTION_TASKS", "Spelling", "kv_cache_spelling", "notice", "old_shape", "translate"]
