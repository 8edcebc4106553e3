"""``rankwise.configs``: ranges declared once as field metadata (``bounded``) and checked with
the types and the dataclass's own ``problems()``, all reported at once."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Union

import pytest

from rankwise import configs, registry
from rankwise.compress.kv.config import KIVICacheConfig, NSNQuantCacheConfig
from rankwise.errors import RankwiseError
from rankwise.recipes.sections import DataConfig, EvalConfig, ModelConfig, TrainConfig


@dataclass
class Example:
    r: int = configs.bounded(8, ge=1)
    dropout: float = configs.bounded(0.0, ge=0.0, lt=1.0)
    timeout: Union[float, None] = configs.bounded(None, gt=0, what="seconds")
    width: int = configs.bounded(64, ge=2, le=4096, what="tokens", hint="(a model's positions)")
    mode: str = "a"

    def problems(self) -> list[str]:
        return ["mode: got 'b'; expected 'a' with r > 4"] if self.mode == "b" and self.r <= 4 else []


@pytest.mark.parametrize("field, value, message", [
    ("r", 0, "r: got 0; expected an integer >= 1"),
    ("dropout", 1.0, "dropout: got 1.0; expected a value in [0, 1)"),
    ("dropout", -0.5, "dropout: got -0.5; expected a value in [0, 1)"),
    ("timeout", 0.0, "timeout: got 0.0; expected seconds > 0 or null"),
    ("width", 5000, "width: got 5000; expected tokens in 2..4096 (a model's positions)"),
])
def test_a_value_outside_its_declared_range_names_the_range(field, value, message):
    assert configs.problems_of(Example(**{field: value})) == [message]


def test_values_inside_the_range_and_values_of_another_kind_pass():
    assert configs.problems_of(Example(r=1, dropout=0.0, timeout=None, width=4096)) == []
    assert configs.problems_of(Example(r=1, dropout=0.999, timeout=1e-9, width=2)) == []


def test_from_dict_reports_types_ranges_and_own_checks_at_once():
    with pytest.raises(RankwiseError) as err:
        configs.from_dict(Example, {"r": 2, "dropout": 2.0, "mode": "b", "colour": 1}, "method")
    text = str(err.value)
    assert "method.colour: unknown key" in text
    # a type error stops the value checks of its section; no type error here, so both kinds show
    with pytest.raises(RankwiseError) as err:
        configs.from_dict(Example, {"r": 2, "dropout": 2.0, "mode": "b"}, "method")
    assert str(err.value) == ("method.dropout: got 2.0; expected a value in [0, 1); "
                              "method.mode: got 'b'; expected 'a' with r > 4")


def configs_with_ranges():
    classes = {DataConfig, EvalConfig, ModelConfig, TrainConfig}
    for kind in registry.kinds():
        for name in registry.names(kind):
            cls = registry.get(kind, name).config_cls
            if dataclasses.is_dataclass(cls):
                classes.add(cls)
    return sorted((c for c in classes if any(configs.RANGE in f.metadata for f in dataclasses.fields(c))),
                  key=lambda c: c.__qualname__)


def test_every_declared_default_lies_in_its_range():
    """A default outside its own range would refuse a config that sets nothing."""
    found = configs_with_ranges()
    assert TrainConfig in found and DataConfig in found
    for cls in found:
        assert configs.range_problems(cls()) == [], cls.__qualname__


def test_the_train_section_declares_its_ranges():
    names = {f.name for f in dataclasses.fields(TrainConfig) if configs.RANGE in f.metadata}
    assert {"steps", "batch_size", "grad_accum", "seed", "distributed_timeout_s",
            "neftune_noise_alpha"} <= names
    assert configs.problems_of(TrainConfig(steps=0, seed=-1)) == [
        "steps: got 0; expected an integer >= 1", "seed: got -1; expected an integer in 0..4294967295"]


@dataclass
class Chooser:
    cache: typing.Any = configs.chosen("kv-cache", None)
    decode: typing.Any = configs.chosen("kv-cache", KIVICacheConfig, hint="(--kv-cache)")


def test_a_chosen_field_builds_the_config_of_the_entry_its_name_names():
    got = configs.from_dict(Chooser, {"cache": {"name": "nsnquant", "bits": 1}, "decode": {"bits": 3}})
    assert got.cache == NSNQuantCacheConfig(bits=1) and got.decode == KIVICacheConfig(bits=3)  # default name
    assert configs.from_dict(Chooser, {}) == Chooser(None, KIVICacheConfig())
    with pytest.raises(RankwiseError) as err:
        configs.from_dict(Chooser, {"cache": {"name": "kiv"}, "decode": {"name": "fp", "bits": 4}}, "x")
    assert str(err.value) == ("x.cache.name: got 'kiv'; expected one of ['fp', 'kivi', 'nsnquant'] "
                              "(did you mean 'kivi'?); x.decode.bits: unknown key; valid keys: name")
    with pytest.raises(RankwiseError, match=r"x.decode: got 3; expected a mapping such as \{name: fp\}$"):
        configs.from_dict(Chooser, {"decode": 3}, "x")


def test_problems_of_checks_the_chosen_entries_of_a_config_made_in_python():
    assert configs.problems_of(Chooser(NSNQuantCacheConfig(bits=3), KIVICacheConfig(chunk=0))) == [
        "cache.bits: got 3; expected an integer in 1..2 (NSNQuant has 1- and 2-bit codebooks)",
        "decode.chunk: got 0; expected an integer >= 1"]
