"""Build config dataclasses from plain dicts (YAML, ``--set``) with helpful errors.

Defaults live only in the dataclasses; this module only validates and overrides them.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from rankwise.errors import RankwiseError, closest

T = TypeVar("T")

# Keys users put in the wrong place, by dotted path -> the one-line fix reported instead of
# "unknown key" (a method package adds the options that only it has, e.g. LoRA's use_dora).
KEY_HINTS: dict[str, str] = {}


def _coerce(value: Any, hint: Any, where: str, problems: list[str]) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any or hint is None:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errs: list[str] = []
        for arg in args:
            if arg is type(None):
                continue
            trial: list[str] = []
            out = _coerce(value, arg, where, trial)
            if not trial:
                return out
            errs.extend(trial)
        problems.append(errs[0] if errs else f"{where}: got {value!r}")
        return value
    if origin is typing.Literal:
        if value not in args:
            problems.append(f"{where}: got {value!r}; expected one of {list(args)}{closest(value, map(str, args))}")
        return value
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            problems.append(f"{where}: got {value!r}; expected a mapping")
            return value
        return _build(hint, value, where, problems)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            problems.append(f"{where}: got {value!r}; expected a list")
            return value
        inner = args[0] if args else Any
        return [_coerce(v, inner, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{where}: got {value!r}; expected a mapping")
            return value
        vt = args[1] if len(args) == 2 else Any
        return {k: _coerce(v, vt, f"{where}.{k}", problems) for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            problems.append(f"{where}: got {value!r}; expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{where}: got {value!r}; expected an integer")
        elif not -2**63 <= value < 2**63:  # nothing downstream (torch, numpy, tokenizers) holds more
            problems.append(f"{where}: got {value}; expected an integer that fits in 64 bits")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where}: got {value!r}; expected a number")
            return value
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            problems.append(f"{where}: got {value!r}; expected a string")
        return value
    return value


def _build(cls: type[T], data: dict, where: str, problems: list[str]) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields and f"{key}_" in fields:  # a field named after a Python keyword (from_)
            key = f"{key}_"
        if key not in fields:
            hint = KEY_HINTS.get(f"{where}.{key}")
            problems.append(f"{where}.{key}: {hint}" if hint else
                            f"{where}.{key}: unknown key{closest(key, fields)}; valid keys: {', '.join(fields)}")
            continue
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}", problems)
    if any(p.startswith(f"{where}.") and "unknown key" not in p for p in problems):
        return None  # type: ignore[return-value]
    try:
        obj = cls(**kwargs)
    except RankwiseError as err:
        problems.append(f"{where}: {err}")
        return None  # type: ignore[return-value]
    except TypeError as err:
        problems.append(f"{where}: {err}")
        return None  # type: ignore[return-value]
    check = getattr(obj, "problems", None)
    if callable(check):
        problems.extend(f"{where}.{p}" for p in check())
    return obj


def from_dict(cls: type[T], data: dict | None, where: str = "config") -> T:
    """Build ``cls`` from ``data``, checking every key and type, reporting all problems at once.

    A dataclass may define ``problems(self) -> list[str]`` for value checks (each item is
    ``"field: message"``); they are reported with the rest.

    Args:
        cls: A dataclass type.
        data: Overrides of its defaults (``None`` means all defaults).
        where: The dotted prefix used in error messages (``"method"``).

    Returns:
        The config instance.

    Raises:
        RankwiseError: Listing every unknown key (with the closest valid one) and bad value.
    """
    problems: list[str] = []
    obj = _build(cls, dict(data or {}), where, problems)
    if problems:
        raise RankwiseError("; ".join(problems))
    return obj


def to_dict(obj: Any) -> dict:
    """Return a dataclass as a plain dict (for YAML/JSON)."""
    return dataclasses.asdict(obj)
