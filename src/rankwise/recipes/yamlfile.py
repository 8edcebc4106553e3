"""The YAML reader of run configs and ``--set`` values.

PyYAML's ``SafeLoader`` follows YAML 1.1, which surprises people writing configs in three ways:

* ``1e-3`` (no dot) is a *string*: 1.1's float pattern needs a ``.`` in the mantissa, so
  ``optim.lr: 1e-3`` failed with "expected a number";
* ``2:4`` is the *integer* 124: 1.1 reads base-60 ("sexagesimal") integers and floats, so
  ``compress.pattern=2:4`` silently became 124;
* a key written twice in one mapping (two ``data:`` sections) keeps the last one without a
  word.

:class:`ConfigLoader` is ``SafeLoader`` with YAML 1.2's number patterns (a float is a decimal
with a dot or an exponent or both, ``.inf``/``.nan``; an integer is decimal, ``0x``/``0o``/
``0b``; no base 60) and a duplicate key check that names both lines. Everything else (booleans,
nulls, dates, anchors and merge keys ``<<``) is ``SafeLoader``'s.
"""
from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, ScalarNode

_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"

# YAML 1.2 core schema (underscores kept as in 1.1: ``1_000`` is a thousand)
INT_RE = re.compile(r"""^(?:[-+]?[0-9][0-9_]*
                        |0o[0-7_]+
                        |0x[0-9a-fA-F_]+
                        |0b[01_]+)$""", re.X)
FLOAT_RE = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                          |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                          |[-+]?\.(?:inf|Inf|INF)
                          |\.(?:nan|NaN|NAN))$""", re.X)


class DuplicateKeyError(ConstructorError):
    """A mapping names the same key twice (``problem_mark`` is the second one)."""

    def __init__(self, key: Any, first: yaml.Mark, second: yaml.Mark) -> None:
        super().__init__(None, None, f"duplicate key {key!r} (first at line {first.line + 1}); "
                         "keep one of them", second)
        self.key, self.first, self.second = key, first, second


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2 numbers and an error on duplicate keys."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict:
        """Build a mapping, refusing a key that appears twice in it (merge keys ``<<`` may
        still be overridden, as YAML intends)."""
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE or not isinstance(key_node, ScalarNode):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise DuplicateKeyError(key, seen[key], key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: ScalarNode) -> int:
        """An integer in decimal, ``0x``, ``0o`` or ``0b`` (no YAML 1.1 octal ``012``)."""
        value = self.construct_scalar(node).replace("_", "")
        sign = -1 if value.startswith("-") else 1
        value = value.lstrip("+-")
        for prefix, base in (("0x", 16), ("0o", 8), ("0b", 2)):
            if value.startswith(prefix):
                return sign * int(value[2:], base)
        return sign * int(value)


ConfigLoader.add_implicit_resolver(_INT, INT_RE, list("-+0123456789"))
ConfigLoader.add_implicit_resolver(_FLOAT, FLOAT_RE, list("-+0123456789."))
ConfigLoader.add_constructor(_INT, ConfigLoader.construct_yaml_int)


class ConfigDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes every string :class:`ConfigLoader` or a YAML 1.1 reader
    (``yaml.safe_load``) would read as something else (``'1e-3'``, ``'2:4'``), so a written
    ``config.yaml`` reads back as it was, by rankwise and by other tools."""

    yaml_implicit_resolvers = {
        first: list(yaml.SafeDumper.yaml_implicit_resolvers.get(first, []))
        + list(ConfigLoader.yaml_implicit_resolvers.get(first, []))
        for first in set(yaml.SafeDumper.yaml_implicit_resolvers) | set(ConfigLoader.yaml_implicit_resolvers)}


def dump(data: Any, **kwargs: Any) -> str:
    """Write ``data`` as YAML that :func:`load` reads back unchanged (``yaml.safe_dump``'s
    keyword arguments)."""
    return yaml.dump(data, Dumper=ConfigDumper, **kwargs)


def load(text: str) -> Any:
    """Parse one YAML document with :class:`ConfigLoader`.

    Raises:
        yaml.YAMLError: Malformed YAML; :class:`DuplicateKeyError` for a repeated key.
    """
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass
