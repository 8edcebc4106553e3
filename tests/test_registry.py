"""``rankwise.registry``: capabilities are per kind, so one given to the wrong kind is refused
(it would otherwise be ignored without a word)."""
from __future__ import annotations

import dataclasses

import pytest

from rankwise import registry


def test_a_capability_of_another_kind_is_refused_with_the_kinds_own_list():
    with pytest.raises(ValueError, match=r"method 'x-test': state_floats is not a capability of kind "
                                         r"'method'; its capabilities: exporters, factorized"):
        registry.register("method", "x-test", None, lambda *a: None, state_floats=lambda *a: 0)
    with pytest.raises(ValueError, match="its capabilities: none"):
        registry.register("task", "x-test", None, object, writes="x")
    assert ("method", "x-test") not in registry._ENTRIES and ("task", "x-test") not in registry._ENTRIES


def test_every_capability_belongs_to_some_kind_and_every_kind_is_listed():
    optional = {f.name for f in dataclasses.fields(registry.Entry)} - {
        "kind", "name", "config_cls", "builder", "summary"}
    assert set().union(*registry.CAPABILITIES.values()) == optional
    for kind in ("method", "optimizer", "task", "command", "tracker", "compressor", "strategy", "exporter",
                 "kv-cache", "merge-rule", "schedule", "order", "reward", "steer", "select-rule"):
        assert kind in registry.kinds() and registry.names(kind), kind


def test_the_builtin_entries_use_only_their_kinds_capabilities():
    """Every registered entry differs from the defaults only in its kind's capabilities."""
    fields = {f.name: f for f in dataclasses.fields(registry.Entry)}
    for kind in registry.kinds():
        for name in registry.names(kind):
            entry = registry.get(kind, name)
            for cap, f in fields.items():
                if cap in registry.CAPABILITIES[kind] or cap in ("kind", "name", "config_cls", "builder", "summary"):
                    continue
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                assert getattr(entry, cap) == default, (kind, name, cap)


def test_the_schedule_and_order_kinds_hold_their_entries():
    """``data.schedule`` and ``data.order`` choose registry entries; GRPO's order names its task."""
    assert registry.names("schedule") == ["none", "skrull"]
    assert registry.names("order") == ["gain-rl", "uniform"]
    assert registry.get("order", "gain-rl").tasks == ("grpo",) and registry.get("order", "uniform").tasks == ()
    for kind in ("schedule", "order"):
        for name in registry.names(kind):
            assert registry.get(kind, name).config_cls().name == name
