"""``rankwise.configs``: ranges declared once as field metadata (``bounded``) and checked with
the types and the dataclass's own ``problems()``, all reported at once."""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from pathlib import Path
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


@dataclass
class Picks:
    mode: typing.Literal["ipm", "kpm"] = "ipm"
    maybe: typing.Optional[typing.Literal["a", "b"]] = None
    either: typing.Union[typing.Literal["auto"], int] = "auto"  # two kinds: only from_dict's type check


def test_a_literal_field_of_a_config_made_in_python_is_refused_in_from_dicts_words():
    assert configs.problems_of(Picks(mode="kmp", maybe="c", either="x")) == [
        "mode: got 'kmp'; expected one of ['ipm', 'kpm'] (did you mean 'kpm'?)",
        "maybe: got 'c'; expected one of ['a', 'b']"]
    assert configs.problems_of(Picks(maybe="b", either=3)) == []
    with pytest.raises(RankwiseError) as err:  # the same words, reported once
        configs.from_dict(Picks, {"mode": "kmp"}, "m")
    assert str(err.value) == "m.mode: got 'kmp'; expected one of ['ipm', 'kpm'] (did you mean 'kpm'?)"


def test_every_registered_config_default_is_one_of_its_literal_choices():
    for kind in registry.kinds():
        for name in registry.names(kind):
            cls = registry.get(kind, name).config_cls
            if dataclasses.is_dataclass(cls):
                assert configs.literal_problems(cls()) == [], (kind, name)
    for cls in (DataConfig, EvalConfig, ModelConfig, TrainConfig):
        assert configs.literal_problems(cls()) == [], cls.__qualname__


def test_a_subclass_that_redeclares_a_bounded_field_keeps_its_range():
    """``r: int = 2`` in a subclass of a config whose ``r`` is ``bounded`` would drop the range
    without a word; every registered config re-declares such a field with ``bounded``."""
    lost = []
    for cls in configs_with_ranges() + [registry.get(k, n).config_cls for k in registry.kinds()
                                        for n in registry.names(k)]:
        if not dataclasses.is_dataclass(cls):
            continue
        own = {f.name: f for f in dataclasses.fields(cls)}
        for base in cls.__mro__[1:]:
            for f in dataclasses.fields(base) if dataclasses.is_dataclass(base) else ():
                if configs.RANGE in f.metadata and configs.RANGE not in own[f.name].metadata:
                    lost.append(f"{cls.__qualname__}.{f.name} (bounded in {base.__qualname__})")
    assert not lost, lost


# `out.append(f"x: got {self.x}...")`: a check written by hand in a problems() method. Of the 57
# left (issue 33 item 6), 26 are not ranges of one field: choices among strings (init,
# router_init, latent_fusion, ...), checks relating two fields (top_k <= num_experts, group_size a
# multiple of dim, r_max >= r_min), a required value (DistillConfig.student_hidden), values of two
# types (select's budget, Q3R's rank, a list's elements). The 31 others sit in files other work
# owned while this was converted: tasks/ (DPO, SimPO, GKD, GRPO, memory decoder), adapters/lora,
# recipes/sections.py (auto-or-number keys), federated/config.py, federated/strategies,
# obfuscation.py. A new single-field range check uses configs.bounded.
HAND_WRITTEN = re.compile(r'out\.append\(f"([a-z_]+): got \{self\.\1[!}]')
HAND_WRITTEN_LEFT = 57


def test_hand_written_range_checks_only_go_down():
    src = Path(configs.__file__).parent
    found = [f"{p.relative_to(src)}:{i}" for p in sorted(src.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if HAND_WRITTEN.search(line)]
    assert len(found) <= HAND_WRITTEN_LEFT, (f"{len(found)} hand-written checks (at most {HAND_WRITTEN_LEFT}); "
                                             "declare a field's range with configs.bounded", found)


def _converted():
    from rankwise.adapters.mixture.config import MoeLoraConfig
    from rankwise.commands.generate.decode import DecodeConfig
    from rankwise.compress.lowrank.config import SVDConfig
    from rankwise.data.select import SelectConfig
    from rankwise.federated.vfl.config import VFLConfig
    from rankwise.optim.galore.config import GaLoreConfig
    return [
        (MoeLoraConfig(mass_threshold=1.5), "mass_threshold: got 1.5; expected a value in [0, 1] (0: fixed top-k)"),
        (MoeLoraConfig(r=0), "r: got 0; expected an integer >= 1"),       # re-declared, still bounded
        (GaLoreConfig(rank=0), "rank: got 0; expected an integer >= 1 such as 64"),
        (VFLConfig(test_fraction=1.0), "test_fraction: got 1.0; expected a value in (0, 1)"),
        (SVDConfig(rank=0), "rank: got 0; expected an integer >= 1 or null (null: use energy)"),
        (DecodeConfig(top_p=0.0), "top_p: got 0.0; expected a value in (0, 1] (--top-p)"),
        (SelectConfig(influence_l2=0.0), "influence_l2: got 0.0; expected a value > 0"),
    ]


@pytest.mark.parametrize("index", range(7))
def test_the_converted_checks_say_what_the_hand_written_ones_said(index):
    config, message = _converted()[index]
    assert configs.problems_of(config) == [message]
