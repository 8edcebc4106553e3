"""``rankwise.configs``: ranges declared once as field metadata (``bounded``) and checked with
the types and the dataclass's own ``problems()``, all reported at once."""
from __future__ import annotations

import dataclasses
import math
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


# `out.append(f"x: got {self.x}...")`: a check written by hand in a problems() method. None of
# the 22 left (issue 33 item 6) is a range or a string choice of one field: checks relating two
# fields (top_k <= num_experts, group_size a multiple of dim, r_max >= r_min, grad_accum dividing
# batch_size, min_clients <= clients, dropout with target_parameters, block_size with pattern),
# a required value (DistillConfig.student_hidden), values of two types (select's budget, Q3R's
# rank, federated.strategy), a list's elements (capacities, cores, batch_sizes, labels), an
# open set of names (LoRA's pissa_niter_N), 'N:M' parsing, and integer sets (LoTA's bits, a
# quantizer's bits: a Literal[2, 4, 8] would let 4.0 and true through, from_dict compares by ==).
# A new single-field range check uses configs.bounded; a choice among strings, a Literal.
HAND_WRITTEN = re.compile(r'out\.append\(f"([a-z_]+): got \{self\.\1[!}]')
HAND_WRITTEN_LEFT = 22


def test_hand_written_range_checks_only_go_down():
    src = Path(configs.__file__).parent
    found = [f"{p.relative_to(src)}:{i}" for p in sorted(src.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if HAND_WRITTEN.search(line)]
    assert len(found) <= HAND_WRITTEN_LEFT, (f"{len(found)} hand-written checks (at most {HAND_WRITTEN_LEFT}); "
                                             "declare a field's range with configs.bounded", found)


def _converted():
    from rankwise.adapters.lora.config import LoraConfig
    from rankwise.adapters.mixture.config import MoeLoraConfig
    from rankwise.adapters.smore.config import SmoreConfig
    from rankwise.commands.generate.decode import DecodeConfig
    from rankwise.compress.clone.config import DistillConfig
    from rankwise.compress.glvq.config import GLVQConfig
    from rankwise.compress.lowrank.config import SVDConfig
    from rankwise.federated.strategies.leff import LeffConfig
    from rankwise.federated.strategies.yoco import YocoConfig
    from rankwise.federated.vfl.config import VFLConfig
    from rankwise.obfuscation import ObfuscateConfig
    from rankwise.optim.adamw import AdamWConfig
    from rankwise.optim.galore.config import GaLoreConfig
    from rankwise.recipes.select_rules import InfluenceConfig
    from rankwise.optim.sumo.config import SumoConfig
    from rankwise.tasks.dpo.task import DPOConfig
    from rankwise.tasks.gkd.task import GKDConfig
    from rankwise.tasks.grpo.config import GRPOConfig
    from rankwise.tasks.memory_decoder.task import MemoryDecoderConfig
    from rankwise.tasks.reward.task import RewardConfig
    from rankwise.tasks.simpo.task import SimPOConfig
    return [
        # issue 33 item 6, the second pass: the hand-written words kept as what= / hint=
        (GKDConfig(teacher="t", temperature=0.0),
         "temperature: got 0.0; expected a value > 0 (GKD samples completions at it)"),
        (GKDConfig(teacher="t", lmbda=1.5), "lmbda: got 1.5; expected a value in [0, 1]"),
        (GRPOConfig(num_generations=1),
         "num_generations: got 1; expected an integer >= 2 (GRPO's advantages compare completions within a group)"),
        (GRPOConfig(epsilon_high=-0.1), "epsilon_high: got -0.1; expected a value >= 0 or null"),
        (GRPOConfig(length_target=0), "length_target: got 0; expected characters >= 1"),
        (DPOConfig(label_smoothing=0.5), "label_smoothing: got 0.5; expected a value in [0, 0.5)"),
        (SimPOConfig(gamma=-0.5), "gamma: got -0.5; expected a margin >= 0 (SimPO's target reward margin)"),
        (RewardConfig(center_rewards_coefficient=math.inf),
         "center_rewards_coefficient: got inf; expected a value in [0, inf) (0: off; TRL recommends 0.01)"),
        (MemoryDecoderConfig(base="b", flat_max_mb=0.0), "flat_max_mb: got 0.0; expected megabytes > 0"),
        (MemoryDecoderConfig(base="b", lam=1.5), "lam: got 1.5; expected a value in [0, 1]"),
        (SumoConfig(projector="oja", oja_bits=9), "oja_bits: got 9; expected an integer in 2..8 or null (int8 codes)"),
        (AdamWConfig(loraplus_lr_ratio=0.0),
         "loraplus_lr_ratio: got 0.0; expected eta_B / eta_A > 0 or null (the paper uses 16; null: plain AdamW)"),
        (TrainConfig(threads=0), "threads: got 0; expected an integer in 1..4096 or auto"),
        (TrainConfig(grad_clip=-1.0),
         "grad_clip: got -1.0; expected a norm >= 0 or null (null or 0: off; auto: the optimizer's choice)"),
        (ObfuscateConfig(mask_scale=0.0), "mask_scale: got 0.0; expected a number > 0"),
        (YocoConfig(sparse_weight=-1.0), "sparse_weight: got -1.0; expected a value >= 0"),
        (LeffConfig(temperature=0.0), "temperature: got 0.0; expected a value > 0"),
        (LoraConfig(eva_rho=0.5), "eva_rho: got 0.5; expected a number >= 1 (1: no redistribution)"),
        (LoraConfig(loftq_iter=0), "loftq_iter: got 0; expected an integer >= 1"),
        # string choices now Literal types: a config made in Python is refused in from_dict's words
        (LoraConfig(corda_mode="kmp"), "corda_mode: got 'kmp'; expected one of ['ipm', 'kpm'] (did you mean 'kpm'?)"),
        (SmoreConfig(gate_act="gelu"),
         "gate_act: got 'gelu'; expected one of ['relu', 'tanh', 'identity'] (did you mean 'relu'?)"),
        (GLVQConfig(allocation="even"), "allocation: got 'even'; expected one of ['salience', 'uniform']"),
        (DistillConfig(student_hidden=8, init="xavier"), "init: got 'xavier'; expected one of ['svd', 'normal']"),
        (MoeLoraConfig(mass_threshold=1.5), "mass_threshold: got 1.5; expected a value in [0, 1] (0: fixed top-k)"),
        (MoeLoraConfig(r=0), "r: got 0; expected an integer >= 1"),       # re-declared, still bounded
        (GaLoreConfig(rank=0), "rank: got 0; expected an integer >= 1 such as 64"),
        (VFLConfig(test_fraction=1.0), "test_fraction: got 1.0; expected a value in (0, 1)"),
        (SVDConfig(rank=0), "rank: got 0; expected an integer >= 1 or null (null: use energy)"),
        (DecodeConfig(top_p=0.0), "top_p: got 0.0; expected a value in (0, 1] (--top-p)"),
        (InfluenceConfig(target="t", l2=0.0), "l2: got 0.0; expected a value > 0"),
    ]


@pytest.mark.parametrize("index", range(len(_converted())))
def test_the_converted_checks_say_what_the_hand_written_ones_said(index):
    config, message = _converted()[index]
    assert configs.problems_of(config) == [message]
