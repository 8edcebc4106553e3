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

And the data section's schedule and order, from before they were registry entries
(:func:`data_spelling`): ``data.schedule_linear`` / ``data.schedule_bucket`` read as
``data.schedule: {name: skrull, linear: ..., bucket: ...}``, and GRPO's ``task.gain_rl`` as the
keys of ``data.order: {name: gain-rl, ...}``.
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


SCHEDULE_KEYS = {"schedule_linear": "linear", "schedule_bucket": "bucket"}  # old data key -> skrull's
ROLLOUT_TASKS = ("grpo", "rloo")  # whose task section held gain_rl before data.order had keys


def data_spelling(data: dict) -> tuple[dict, str | None]:
    """``data.schedule`` and ``data.order`` in the new spelling (see the module docstring).

    Args:
        data: The raw config in the task's new spelling (after :func:`translate`; not changed).

    Returns:
        ``(data in the new spelling, the one-line notice or None)``.
    """
    section = data.get("data")
    section = section if isinstance(section, dict) else {}
    task = data.get("task") if isinstance(data.get("task"), dict) else {}
    flat = {new: section[old] for old, new in SCHEDULE_KEYS.items() if old in section}
    gain = task.get("gain_rl")
    if not flat and "gain_rl" not in task:
        return data, None
    new_data = {k: v for k, v in section.items() if k not in SCHEDULE_KEYS}
    said = []
    if flat:
        schedule = section.get("schedule", "none")  # none: its keys are then refused in one line
        schedule = {"name": schedule} if isinstance(schedule, str) else dict(schedule or {})
        new_data["schedule"] = {**schedule, **{k: v for k, v in flat.items() if v is not None}}
        said.append(f"data.{' and data.'.join(k for k in SCHEDULE_KEYS if k in section)} "
                    f"{'is' if len(flat) == 1 else 'are'} the old spelling of data.schedule: "
                    f"{_inline(new_data['schedule'])}")
    new = {**data, "data": new_data}
    if "gain_rl" in task:
        new["task"] = {k: v for k, v in task.items() if k != "gain_rl"}
        order = section.get("order", "uniform")
        order = {"name": order} if isinstance(order, str) else dict(order or {})
        if order.get("name") == "gain-rl":
            new_data["order"] = {**order, **(gain if isinstance(gain, dict) else {})}
            said.append(f"task.gain_rl is the old spelling of data.order: {_inline(new_data['order'])}")
        else:
            said.append("task.gain_rl is the old spelling of data.order: {name: gain-rl, ...}'s keys "
                        "(without data.order: gain-rl it has no effect; it is left out)")
    return new, f"notice: {'; '.join(said)}; read until the next release"


def _inline(value: dict) -> str:
    """``{name: skrull, bucket: 4096}``: one YAML flow line."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6).strip()


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
    ``task:`` section of their settings, if any); ``data.schedule`` and ``data.order`` as names,
    with Skrull's keys as ``data.schedule_linear`` / ``schedule_bucket`` and GAIN-RL's as the
    rollout task's ``gain_rl`` (:func:`data_spelling` read backwards); ``data.select`` as the
    flat section of every rule (:func:`rankwise.recipes.legacy_select.old_select`).

    Args:
        resolved: The resolved config as plain data.

    Returns:
        A new mapping; ``resolved`` is not changed.
    """
    task = resolved.get("task")
    if not isinstance(task, dict):
        return resolved
    out = {k: v for k, v in resolved.items() if k != "task"}
    rest = {k: v for k, v in task.items() if k != "name"}
    data = out.get("data")
    if isinstance(data, dict) and isinstance(data.get("schedule"), dict):
        schedule, order = data["schedule"], data.get("order") or {}
        data = {**data, "schedule": schedule.get("name"),
                "schedule_linear": schedule.get("linear"), "schedule_bucket": schedule.get("bucket")}
        data["order"] = order.get("name") if isinstance(order, dict) else order
        if task.get("name") in ROLLOUT_TASKS:
            from rankwise.tasks.grpo.config import GainRLConfig
            gain = order if isinstance(order, dict) and order.get("name") == "gain-rl" else \
                dataclasses.asdict(GainRLConfig())
            rest["gain_rl"] = {k: v for k, v in gain.items() if k != "name"}
        out["data"] = data
    if isinstance(out.get("data"), dict) and "select" in out["data"]:  # the flat select of every rule
        from rankwise.recipes.legacy_select import old_select
        out["data"] = {**out["data"], "select": old_select(out["data"]["select"])}
    out["model"] = {**(out.get("model") or {}), "task": task.get("name")}
    side = next((s for s, t in SECTION_TASKS.items() if t == task.get("name")), None)
    if side is not None:
        out[side] = rest
    elif rest:
        out["task"] = rest
    return out


__all__ = ["SECTION_TASKS", "Spelling", "data_spelling", "kv_cache_spelling", "notice", "old_shape",
           "translate"]
