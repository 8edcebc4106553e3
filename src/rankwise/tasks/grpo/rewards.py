"""Reward functions of ``task.name: grpo``: built-ins and ``module:function`` callables.

A reward function has TRL's signature, so functions written for ``trl.GRPOTrainer`` port
unchanged::

    def reward(prompts: list[str], completions: list[str], **columns) -> list[float]

``prompts[i]`` and ``completions[i]`` are the prompt text and one sampled completion (a prompt
appears once per completion of its group); ``columns`` are the record's other fields, as lists
aligned with ``completions`` (``columns["answer"][i]``). It returns one float per completion.

Built-ins, each an entry of the registry kind ``reward`` with its own config (a bare name takes
its defaults; a mapping sets its keys: ``rewards: [{name: regex, pattern: "def "}]``; a
package or a user's module may register more, :func:`rankwise.registry.register`):

* ``exact-match`` (:class:`ExactMatchReward`): 1.0 when the completion, stripped, equals the
  record's answer field (stripped), else 0.0;
* ``regex`` (:class:`RegexReward`): 1.0 when ``pattern`` matches at the start of the stripped
  completion (``re.match``); ``{answer}`` in the pattern is replaced by the record's answer,
  escaped;
* ``python-parses`` (:class:`PythonParsesReward`): 1.0 when the completion parses as Python
  (``ast.parse``), also when it is a block header whose body is missing (``def f(x):`` parses
  with ``pass`` appended), else 0.0;
* ``length-penalty`` (:class:`LengthPenaltyReward`): ``-len(completion) / target`` (characters).

A key a reward's mapping leaves unset (``null``) comes from the task's section: ``answer_field``,
``pattern`` and ``length_target`` there are the defaults of every reward that reads them (the
spelling of earlier releases, which keeps working unchanged).

A reward spelled as a path (``./runs/rm``, ``/models/rm``) is a trained reward model: the run
folder of a ``task.name: reward`` run or a one-output sequence classifier's model folder, which
scores each ``(prompt, completion)`` (:mod:`rankwise.tasks.grpo.reward_model`).

``module:function`` imports ``module`` from ``PYTHONPATH`` first, then from ``grpo.rewards_dir``
(the config file's folder by default), so a ``rewards.py`` next to the config needs no
``PYTHONPATH``. Python callables handed to ``rankwise.train`` (TRL's ``reward_funcs=[fn]``) are
named by :func:`name_callables`: ``module:function`` when that imports back to the same function
(a resumed run from the CLI finds it), else ``python:<name>``, which resolves in this process only.
"""
from __future__ import annotations

import ast
import importlib
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Union

from rankwise import registry
from rankwise.configs import bounded, from_dict
from rankwise.errors import RankwiseError
from rankwise.tasks.grpo.reward_model import RewardModel, is_model_spelling

BUILTINS = ("exact-match", "regex", "python-parses", "length-penalty")  # the built-in entries
RewardFn = Callable[..., list]
CALLABLES: dict[str, RewardFn] = {}  # python:<name> -> the callable handed over in this process


def _answers(columns: dict[str, list], field: str, n: int) -> list[str]:
    if field not in columns:
        raise RankwiseError(f"the reward needs the answer field {field!r}, which the records lack "
                            f"(fields: {', '.join(sorted(columns)) or 'none'}); set grpo.answer_field")
    return ["" if a is None else str(a) for a in columns[field]][:n]


def exact_match(field: str) -> RewardFn:
    """``exact-match`` on the record's ``field``."""
    def reward(prompts, completions, **columns):
        answers = _answers(columns, field, len(completions))
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answers)]
    return reward


def regex(pattern: str, field: str) -> RewardFn:
    """``regex``: ``pattern`` (``{answer}`` = the record's escaped answer) at the completion's start."""
    def reward(prompts, completions, **columns):
        if "{answer}" in pattern:
            answers = _answers(columns, field, len(completions))
            pats = [pattern.replace("{answer}", re.escape(a.strip())) for a in answers]
        else:
            pats = [pattern] * len(completions)
        return [float(re.match(p, c.strip()) is not None) for p, c in zip(pats, completions)]
    return reward


def _parses(text: str) -> bool:
    for candidate in (text, text.rstrip() + " pass"):
        try:
            ast.parse(candidate)
            return True
        except (SyntaxError, ValueError):
            continue
    return False


def python_parses(prompts, completions, **columns) -> list[float]:
    """``python-parses``: 1.0 for a completion that is valid Python (a bare header counts)."""
    return [float(bool(c.strip()) and _parses(c.strip())) for c in completions]


def length_penalty(target: int) -> RewardFn:
    """``length-penalty``: minus the completion's characters over ``target``."""
    def reward(prompts, completions, **columns):
        return [-len(c) / target for c in completions]
    return reward


def _importable_name(fn: Any) -> str | None:
    """``module:function`` if importing it gives back ``fn`` itself (not ``__main__``, a lambda,
    a nested function or a method)."""
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qual or module == "__main__" or not qual.isidentifier():
        return None
    try:
        found = getattr(importlib.import_module(module), qual)
    except Exception:  # noqa: BLE001 - any failure means: not importable by name
        return None
    return f"{module}:{qual}" if found is fn else None


def name_callables(rewards: list) -> list[str]:
    """``grpo.rewards`` with each callable replaced by a name :func:`resolve` finds.

    Args:
        rewards: Names and callables (``fn(prompts, completions, **columns) -> list[float]``).

    Returns:
        Names: ``module:function`` for importable functions, else ``python:<name>`` (``#2``... for
        two callables of one name), registered in :data:`CALLABLES` for this process.
    """
    out: list[str] = []
    for item in rewards:
        if not callable(item):
            out.append(item)
            continue
        name = _importable_name(item)
        if name is None:
            base = f"python:{getattr(item, '__qualname__', None) or type(item).__name__}"
            name, k = base, 2
            while name in out:
                name, k = f"{base}#{k}", k + 1
            CALLABLES[name] = item
        out.append(name)
    return out


def builtin_names() -> list[str]:
    """Every registered reward (the built-ins and any a package or user module registered)."""
    return registry.names("reward")


def spec_name(spec: Union[str, dict]) -> str:
    """The name a reward is known by (its key in ``samples.jsonl`` and the metrics): the string,
    or a mapping's ``name``."""
    return spec.get("name", "") if isinstance(spec, dict) else spec


def keyed(specs: list) -> dict[str, Union[str, dict]]:
    """``{key: spec}`` of ``task.rewards``: each reward's :func:`spec_name`, with ``#2``, ``#3``
    ... after a name that comes again (two ``regex`` rewards of different patterns)."""
    out: dict[str, Union[str, dict]] = {}
    for spec in specs:
        key, k = spec_name(spec), 2
        while key in out:
            key, k = f"{spec_name(spec)}#{k}", k + 1
        out[key] = spec
    return out


def spec_problems(spec: Any, where: str) -> list[str]:
    """Why ``spec`` (one item of ``task.rewards``) cannot name a reward (empty when it can)."""
    if isinstance(spec, dict):
        name = spec.get("name")
        if name not in builtin_names():
            return [f"{where}.name: got {name!r}; a mapping names a registered reward, one of "
                    f"{builtin_names()}"]
        try:
            from_dict(registry.get("reward", name).config_cls, spec, where)
        except RankwiseError as err:
            return [str(err)]
        return []
    if not isinstance(spec, str):
        return [f"{where}: got {spec!r}; expected a reward's name or {{name: ..., its keys}}"]
    if spec not in builtin_names() and ":" not in spec and not is_model_spelling(spec):
        return [f"{where}: got {spec!r}; expected one of {builtin_names()}, 'module:function' or a "
                "reward model's folder (a path: ./runs/rm)"]
    return []


def resolve(spec: Union[str, dict], task: Any = None, rewards_dir: str | None = None) -> RewardFn:
    """The reward function of ``spec``: a registered reward (a name, or ``{name: ..., keys}``;
    keys left ``null`` come from ``task``, the task's section), an importable ``module:function``
    (from ``PYTHONPATH``, then ``rewards_dir``), a ``python:`` callable of this process, or a
    reward model's run or model folder (a path; relative: read from ``rewards_dir`` first).

    Raises:
        RankwiseError: An unknown name, a module or function that cannot be imported, a name
            that is not callable, or a folder that is not a reward model
            (:class:`~rankwise.tasks.grpo.reward_model.RewardModel`).
    """
    name = spec_name(spec)
    if isinstance(spec, dict) or name in builtin_names():
        entry = registry.get("reward", name)
        config = from_dict(entry.config_cls, spec if isinstance(spec, dict) else {"name": name},
                           "task.rewards")
        return entry.builder(config, task)
    if is_model_spelling(name):
        return RewardModel(name, rewards_dir)
    if ":" not in name:
        raise RankwiseError(f"grpo.rewards: got {name!r}; expected one of {builtin_names()}, "
                            "'module:function' or a reward model's folder (a path: ./runs/rm)")
    if name.startswith("python:"):
        if name not in CALLABLES:
            raise RankwiseError(f"grpo.rewards: {name!r} was a Python callable handed to "
                                "rankwise.train in another process; pass it to rankwise.train again "
                                "(resume=True continues the run), or name an importable module:function")
        return CALLABLES[name]
    module, _, attr = name.partition(":")
    if rewards_dir and rewards_dir not in sys.path:
        sys.path.append(rewards_dir)  # after PYTHONPATH: an installed module of the name wins
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        where = f"PYTHONPATH or {rewards_dir}" if rewards_dir else "PYTHONPATH"
        raise RankwiseError(f"grpo.rewards: cannot import {name!r} ({type(err).__name__}: {err}); "
                            f"check the module is on {where} (grpo.rewards_dir) and the function's "
                            "name") from None
    if not callable(fn):
        raise RankwiseError(f"grpo.rewards: {name!r} is not callable")
    return fn


def score(fns: dict[str, RewardFn], prompts: list[str], completions: list[str],
          columns: dict[str, list], records: list[Any]) -> dict[str, list[float]]:
    """Every reward of every completion: ``{name: [float, ...]}``.

    Args:
        fns: Reward functions by name.
        prompts: One prompt text per completion.
        completions: The completion texts.
        columns: The records' other fields, aligned with ``completions``.
        records: A label per completion (its record), for error messages.

    Raises:
        RankwiseError: A function raised, returned the wrong number of values, or a value that
            is not a finite number (the record is named).
    """
    out = {}
    for name, fn in fns.items():
        try:
            values = fn(prompts=list(prompts), completions=list(completions), **columns)
        except Exception as err:  # a user's function: any failure becomes one line
            raise RankwiseError(f"reward {name!r} raised {type(err).__name__}: {err} (records "
                                f"{_span(records)}); fix the function") from None
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise RankwiseError(f"reward {name!r} returned {got} values for {len(completions)} "
                                "completions; return one float per completion")
        clean = []
        for value, record in zip(values, records):
            try:
                v = float(value)
            except (TypeError, ValueError):
                v = math.nan
            if not math.isfinite(v):
                raise RankwiseError(f"reward {name!r} returned {value!r} for record {record}; "
                                    "return a finite float for every completion")
            clean.append(v)
        out[name] = clean
    return out


def _span(records: list[Any]) -> str:
    unique = list(dict.fromkeys(records))
    return ", ".join(str(r) for r in unique[:5]) + (" ..." if len(unique) > 5 else "")


# ----- the built-in entries of kind ``reward`` -----------------------------------------------
@dataclass
class ExactMatchReward:
    """``exact-match``: the stripped completion equals the record's answer.

    Attributes:
        name: The reward.
        answer_field: The record field compared with (``null``: the task's ``answer_field``).
    """

    name: str = "exact-match"
    answer_field: Union[str, None] = None


@dataclass
class RegexReward:
    """``regex``: ``pattern`` matches at the stripped completion's start.

    Attributes:
        name: The reward.
        pattern: The regular expression; ``{answer}`` is the record's answer, escaped
            (``null``: the task's ``pattern``, which must then be set).
        answer_field: The record field ``{answer}`` reads (``null``: the task's).
    """

    name: str = "regex"
    pattern: Union[str, None] = None
    answer_field: Union[str, None] = None


@dataclass
class PythonParsesReward:
    """``python-parses``: the completion is valid Python (a bare block header counts).

    Attributes:
        name: The reward.
    """

    name: str = "python-parses"


@dataclass
class LengthPenaltyReward:
    """``length-penalty``: minus the completion's characters over ``target``.

    Attributes:
        name: The reward.
        target: Characters per unit of penalty (``null``: the task's ``length_target``).
    """

    name: str = "length-penalty"
    target: Union[int, None] = bounded(None, ge=1, what="characters")


def _task_key(task: Any, key: str, default: Any) -> Any:
    return getattr(task, key, default) if task is not None else default


def _exact_match(config: ExactMatchReward, task: Any) -> RewardFn:
    return exact_match(config.answer_field or _task_key(task, "answer_field", "answer"))


def _regex(config: RegexReward, task: Any) -> RewardFn:
    pattern = config.pattern or _task_key(task, "pattern", None)
    if not pattern:
        raise RankwiseError("reward regex needs a pattern: rewards: [{name: regex, pattern: ...}] "
                            "(or the task's pattern)")
    return regex(pattern, config.answer_field or _task_key(task, "answer_field", "answer"))


def _python_parses(config: PythonParsesReward, task: Any) -> RewardFn:
    return python_parses


def _length_penalty(config: LengthPenaltyReward, task: Any) -> RewardFn:
    return length_penalty(config.target or _task_key(task, "length_target", 200))


registry.register("reward", "exact-match", ExactMatchReward, _exact_match,
                  summary="1 when the stripped completion equals the record's answer")
registry.register("reward", "regex", RegexReward, _regex,
                  summary="1 when a pattern ({answer}: the record's) matches the completion's start")
registry.register("reward", "python-parses", PythonParsesReward, _python_parses,
                  summary="1 when the completion parses as Python (a bare header counts)")
registry.register("reward", "length-penalty", LengthPenaltyReward, _length_penalty,
                  summary="-len(completion) / target characters")


__all__ = ["BUILTINS", "CALLABLES", "ExactMatchReward", "LengthPenaltyReward", "PythonParsesReward",
           "RegexReward", "RewardModel", "builtin_names", "is_model_spelling", "name_callables", "resolve",
           "score", "keyed", "spec_name", "spec_problems", "exact_match", "regex",
           "python_parses", "length_penalty"]
