"""Build config dataclasses from plain dicts (YAML, ``--set``) with helpful errors.

Defaults live only in the dataclasses; this module only validates and overrides them.

A numeric field's range is declared once, where the field is, as metadata::

    r: int = bounded(8, ge=1)                       # "r: got 0; expected an integer >= 1"
    dropout: float = bounded(0.0, ge=0.0, lt=1.0)   # "dropout: got 1.0; expected a value in [0, 1)"

A pluggable part is one registered entry of a registry kind, written ``{name: ..., its keys}``
and declared with :func:`chosen`: ``from_dict`` builds the config class of the entry that
``name`` names (an unknown name is reported with "did you mean")::

    kv_cache: KVCacheConfig = chosen("kv-cache", FPCacheConfig)   # kv_cache: {name: kivi, bits: 4}

A choice among a few strings is a ``Literal`` type (``corda_mode: Literal["ipm", "kpm"]``):
:func:`from_dict` reports another value with "did you mean".

:func:`problems_of` checks every declared range and ``Literal`` choice (so a config built in
Python is refused in the words ``from_dict`` uses) and then calls the dataclass's own
``problems()`` (the checks that relate several fields, or need words of their own);
:func:`from_dict` reports both with the type errors, all at once.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from rankwise.errors import RankwiseError, closest

T = TypeVar("T")

RANGE = "rankwise.range"  # the dataclass field metadata key that holds a field's Bounds
CHOICE = "rankwise.choice"  # ... and the one that holds a chosen field's Choice

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
    misplaced: set[str] = set()  # keys in the wrong place (hinted or unknown): the values are still checked
    for key, value in data.items():
        if key not in fields and f"{key}_" in fields:  # a field named after a Python keyword (from_)
            key = f"{key}_"
        if key not in fields:
            hint = KEY_HINTS.get(f"{where}.{key}")
            msg = (f"{where}.{key}: {hint}" if hint else
                   f"{where}.{key}: unknown key{closest(key, fields)}; valid keys: {', '.join(fields)}")
            misplaced.add(msg)
            problems.append(msg)
            continue
        choice = fields[key].metadata.get(CHOICE)
        kwargs[key] = (choice.build(value, f"{where}.{key}", problems) if choice is not None else
                       _coerce(value, hints[key], f"{where}.{key}", problems))
    if any(p.startswith(f"{where}.") and "unknown key" not in p and p not in misplaced for p in problems):
        return None  # type: ignore[return-value]
    try:
        obj = cls(**kwargs)
    except RankwiseError as err:
        problems.append(f"{where}: {err}")
        return None  # type: ignore[return-value]
    except TypeError as err:
        problems.append(f"{where}: {err}")
        return None  # type: ignore[return-value]
    problems.extend(f"{where}.{p}" for p in problems_of(obj))
    return obj


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The range of a numeric config field (``gt``/``ge`` below, ``lt``/``le`` above).

    Attributes:
        gt, ge, lt, le: Strict and inclusive bounds (``None``: no bound on that side).
        what: The noun of the message (default: ``an integer`` for an int, else ``a value``),
            e.g. ``"seconds"`` reads "expected seconds > 0".
        hint: Words appended to the message (``"(the paper uses 5 to 15)"``).
    """

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    what: str = ""
    hint: str = ""

    def holds(self, value: float) -> bool:
        """Whether ``value`` is inside the range."""
        return ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le))

    def describe(self, integer: bool, nullable: bool) -> str:
        """``an integer >= 1``, ``a value in [0, 1)``, ``seconds > 0 or null`` ..."""
        what = self.what or ("an integer" if integer else "a value")
        lo, hi = _num(self.ge if self.ge is not None else self.gt), _num(self.le if self.le is not None else self.lt)
        if lo is not None and hi is not None:
            if integer and self.ge is not None and self.le is not None:
                text = f"{what} in {lo}..{hi}"
            else:
                text = f"{what} in {'[' if self.ge is not None else '('}{lo}, {hi}{']' if self.le is not None else ')'}"
        elif lo is not None:
            text = f"{what} {'>=' if self.ge is not None else '>'} {lo}"
        else:
            text = f"{what} {'<=' if self.le is not None else '<'} {hi}"
        return text + (" or null" if nullable else "") + (f" {self.hint}" if self.hint else "")


def _num(x: float | None) -> str | None:
    if x is None:
        return None
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def bounded(default: Any = dataclasses.MISSING, *, gt: float | None = None, ge: float | None = None,
            lt: float | None = None, le: float | None = None, what: str = "", hint: str = "") -> Any:
    """A dataclass field whose numeric value must lie in a range (checked by :func:`problems`).

    A value of another kind (``None`` for an optional field, ``"auto"``) is not range-checked:
    its type is checked by :func:`from_dict`.

    Args:
        default: The field's default.
        gt, ge, lt, le: The bounds (see :class:`Bounds`).
        what: The noun of the message.
        hint: Words appended to the message.

    Returns:
        A ``dataclasses.field`` carrying :class:`Bounds` under :data:`RANGE`.
    """
    return dataclasses.field(default=default, metadata={RANGE: Bounds(gt, ge, lt, le, what, hint)})


@dataclasses.dataclass(frozen=True)
class Choice:
    """A field that holds the config of one registered entry of ``kind`` (see :func:`chosen`).

    Attributes:
        kind: The registry kind (``"kv-cache"``, ``"merge-rule"``).
        default: The entry name a mapping without ``name`` takes (``None``: ``name`` is required).
        nullable: Whether ``null`` (no entry at all) is a valid value.
        hint: Words appended to the message of an unknown name (``"(--kv-cache)"``).
    """

    kind: str
    default: str | None = None
    nullable: bool = False
    hint: str = ""

    def build(self, value: Any, where: str, problems: list[str]) -> Any:
        """The chosen entry's config built from ``value`` (``{name: ..., its keys}``, or a bare
        name for that entry's defaults), its problems appended to ``problems`` (prefixed ``where``)."""
        from rankwise import registry
        if value is None and self.nullable:
            return None
        names = registry.names(self.kind)
        if isinstance(value, str):  # a bare name: that entry with its defaults
            value = {"name": value}
        if not isinstance(value, dict):
            problems.append(f"{where}: got {value!r}; expected a mapping such as {{name: {names[0]}}}"
                            f"{' or null' if self.nullable else ''}")
            return value
        name = value.get("name", self.default)
        if name is None:
            problems.append(f"{where}.name: missing; expected one of {names}"
                            f"{' ' + self.hint if self.hint else ''}")
            return None
        if name not in names:
            hint = f" {self.hint}" if self.hint else ""
            problems.append(f"{where}.name: got {name!r}; expected one of {names}{hint}{closest(name, names)}")
            return None
        return _build(registry.get(self.kind, name).config_cls, {**value, "name": name}, where, problems)


def chosen(kind: str, default: type | None = None, *, nullable: bool = False, hint: str = "") -> Any:
    """A dataclass field holding the config of one registered entry of ``kind``, written
    ``{name: ..., its keys}`` (:class:`Choice`); every entry's config class has a ``name`` field.

    Args:
        kind: The registry kind.
        default: The config class of the default entry (``None``: the field defaults to
            ``None``, which then means "none").
        nullable: Whether ``null`` is valid (always when ``default`` is ``None``).
        hint: Words appended to the message of an unknown name.

    Returns:
        A ``dataclasses.field`` carrying the :class:`Choice` under :data:`CHOICE`.
    """
    choice = Choice(kind, getattr(default, "name", None) if default is not None else None,
                    nullable or default is None, hint)
    if default is None:
        return dataclasses.field(default=None, metadata={CHOICE: choice})
    return dataclasses.field(default_factory=default, metadata={CHOICE: choice})


def range_problems(obj: Any) -> list[str]:
    """``"field: got V; expected ..."`` for every declared range of ``obj`` its value leaves."""
    out = []
    hints = None
    for f in dataclasses.fields(obj):
        bounds = f.metadata.get(RANGE)
        value = getattr(obj, f.name, None)
        if bounds is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not bounds.holds(value):
            hints = hints or typing.get_type_hints(type(obj))
            nullable = type(None) in typing.get_args(hints.get(f.name))
            out.append(f"{f.name}: got {value}; expected {bounds.describe(isinstance(value, int), nullable)}")
    return out


def literal_problems(obj: Any) -> list[str]:
    """``"field: got 'x'; expected one of [...]"`` for every ``Literal`` field of ``obj`` (or
    ``Optional[Literal]``) whose value is not one of its choices: the words :func:`from_dict`
    uses, so a config built in Python is refused as one read from YAML."""
    out = []
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        hint = hints.get(f.name)
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            arms = [a for a in typing.get_args(hint) if a is not type(None)]
            if len(arms) != 1 or getattr(obj, f.name, None) is None:
                continue
            hint = arms[0]
        if typing.get_origin(hint) is not typing.Literal:
            continue
        value, args = getattr(obj, f.name, None), typing.get_args(hint)
        if value not in args:
            out.append(f"{f.name}: got {value!r}; expected one of {list(args)}{closest(value, map(str, args))}")
    return out


def problems_of(obj: Any) -> list[str]:
    """Every value error of a config dataclass: its declared ranges and ``Literal`` choices,
    those of the entries its :func:`chosen` fields hold (``kv_cache.bits: ...``), then its own
    ``problems()``.

    Call this (not ``obj.problems()``) where a config built in Python is checked, so the
    declared ranges are checked too.

    Args:
        obj: A config dataclass instance.

    Returns:
        ``"field: message"`` strings (empty when valid).
    """
    out = range_problems(obj) + literal_problems(obj) if dataclasses.is_dataclass(obj) else []
    for f in dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else ():
        part = getattr(obj, f.name, None)
        if CHOICE in f.metadata and dataclasses.is_dataclass(part):  # the chosen entry's own checks
            out.extend(f"{f.name}.{p}" for p in problems_of(part))
    own = getattr(obj, "problems", None)
    if callable(own):
        out.extend(p for p in own() if p not in out)
    return out


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
