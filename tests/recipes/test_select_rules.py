"""The selection rules as registry kind ``select-rule``: each rule's config holds only its keys
and refuses another rule's in one line naming the rule that has it; a bare name is the rule with
its defaults; a rule registered from this module (outside the package) is chosen by name and
chooses what its scoring function says, through ``rankwise select`` and a run's ``prepare``.
(The rules' maths: ``tests/data/test_select.py``; the stage: ``test_select_stage.py``.)"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise import registry
from rankwise.cli import main
from rankwise.configs import bounded
from rankwise.errors import RankwiseError
from rankwise.recipes.config import build_run_config, load_run_config
from rankwise.recipes.select import record_ids
from rankwise.recipes.select_rules import (InfluenceConfig, LessConfig, QCSProxyConfig, RandomConfig, Scored,
                                           SelectInputs, SelectRuleConfig)
from rankwise.recipes.session import prepare

BUILTIN = ("embedding", "influence", "less", "qcs-proxy", "random", "reuse")
LLAMA = {"path": "tiny-llama"}


def _keys(name: str) -> set[str]:
    return {f.name.rstrip("_") for f in dataclasses.fields(registry.get("select-rule", name).config_cls)}


def _build(select) -> object:
    return build_run_config({"model": LLAMA, "data": {"select": select}}, notice=False).data.select


def test_the_builtin_rules_are_registered_with_their_own_keys():
    assert set(registry.names("select-rule")) >= set(BUILTIN)
    for name in BUILTIN:
        assert registry.get("select-rule", name).config_cls().name == name
    common = {"name", "budget", "target", "target_size", "from", "seed"}
    assert _keys("random") == _keys("embedding") == common
    assert _keys("less") == common | {"proj_dim", "warmup_steps", "warmup_lr"}
    assert _keys("influence") - _keys("less") == {"weights", "landmarks", "jvp_tangents", "ridge", "eta", "l2"}
    assert _keys("qcs-proxy") - _keys("less") == {"weights", "steps", "samples", "lr", "eta", "token_ratio",
                                                  "token_floor"}
    assert _keys("reuse") == {"name", "from", "weights"}
    assert _build("random") == RandomConfig() and _build({"from": "sel"}).name == "reuse"  # bare name; no name
    assert _build({"name": "qcs-proxy", "target": "t", "steps": 7}) == QCSProxyConfig(target="t", steps=7)
    assert _build(None) is None


@pytest.mark.parametrize("name", BUILTIN)
def test_each_rule_refuses_another_rules_key_in_one_line(name):
    needs = {"from": "sel"} if name == "reuse" else {"target": "t.jsonl"}
    others = sorted(set().union(*(_keys(n) for n in BUILTIN)) - _keys(name))
    assert others, name
    for key in others:
        with pytest.raises(RankwiseError) as err:
            _build({"name": name, **needs, key: 1})
        msg, having = str(err.value), [n for n in BUILTIN if key in _keys(n)]
        assert msg.startswith(f"data.select.{key}: {key} is a setting of ") and "\n" not in msg, msg
        assert msg.count("is a setting of") == 1 and "unknown key" not in msg, msg
        if name == "reuse" and key in _keys("random"):  # a key every scoring rule has
            assert "not of reuse" in msg and "name a rule" in msg, msg
        else:  # the fix names a rule that has the key
            assert re.search(rf"set data.select: \{{name: ([a-z-]+), {key}: \.\.\.\}}", msg).group(1) in having, msg


def test_weights_is_refused_where_the_rule_makes_none():
    for name in ("random", "embedding", "less"):
        with pytest.raises(RankwiseError, match=r"^data.select.weights: weights is a setting of influence, "
                                                r"qcs-proxy and reuse; set data.select: \{name: influence"):
            _build({"name": name, "target": "t", "weights": True})
    assert _build({"name": "influence", "target": "t", "weights": True}) == InfluenceConfig(target="t", weights=True)


def test_every_problem_of_a_rule_is_reported_at_once():
    """A key of another rule does not hide the ranges and checks of the rule's own keys."""
    with pytest.raises(RankwiseError) as err:
        _build({"name": "influence", "budget": 0, "l2": 0, "landmarks": 0, "steps": 3})
    text = str(err.value)
    for needle in ("data.select.steps: steps is a setting of qcs-proxy", "data.select.landmarks: got 0; "
                   "expected an integer >= 1", "data.select.l2: got 0.0; expected a value > 0",
                   "data.select.budget: got 0;", "data.select.target: rule 'influence' needs data standing "
                   "for the target task"):
        assert needle in text, text
    assert "\n" not in text


# --- a rule defined outside the package: one config class and one scoring function ---

@dataclass
class FirstKConfig(SelectRuleConfig):
    """``first-k``: the first ``k`` pool records after skipping ``offset``.

    Attributes:
        name: The rule.
        offset: Pool records skipped.
    """

    name: str = "first-k"
    offset: int = bounded(0, ge=0)


def first_k(cfg: FirstKConfig, inputs: SelectInputs) -> Scored:
    """Scores ``-i`` shifted by ``offset`` (the earliest records score highest)."""
    n = len(inputs.pool)
    s = -((torch.arange(n, dtype=torch.float64) - cfg.offset) % n)
    return Scored(s, sorted(range(cfg.offset, cfg.offset + inputs.k)))


registry.register("select-rule", "first-k", FirstKConfig, first_k, summary="the first k records (a test)")


def _cfg(tmp: Path, source: Path, select: dict | None) -> Path:
    path = tmp / f"first-k-{len(list(tmp.glob('first-k-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": "tiny-bert"}, "task": {"name": "classification"},
        "data": {"source": str(source), "max_length": 24, "select": select},
        "method": {"name": "lora", "r": 2, "targets": ["query", "value"]},
        "optim": {"name": "adamw", "lr": 0.01}, "train": {"steps": 2, "batch_size": 4, "progress": False}}))
    return path


def test_a_rule_registered_outside_the_package_is_chosen_by_name(tmp_path, docstrings_jsonl):
    cfg_path = _cfg(tmp_path, docstrings_jsonl, {"name": "first-k", "budget": 3, "offset": 2})
    cfg = load_run_config(cfg_path)
    assert cfg.data.select == FirstKConfig(budget=3, offset=2)
    full = prepare(load_run_config(_cfg(tmp_path, docstrings_jsonl, None)), device="cpu")
    ids = record_ids(cfg.data, full.train_data)
    session = prepare(cfg, device="cpu")  # the run's stage keeps pool records 2, 3, 4
    assert record_ids(cfg.data, session.train_data) == ids[2:5]
    res = CliRunner().invoke(main, ["select", str(cfg_path), "--out", str(tmp_path / "sel")])
    assert res.exit_code == 0, res.output
    chosen = json.loads((tmp_path / "sel" / "chosen.json").read_text())
    assert chosen["method"] == "first-k" and chosen["ids"] == ids[2:5] and chosen["k"] == 3
    res = CliRunner().invoke(main, ["list"])
    assert any(line.split()[:2] == ["select-rule", "first-k"] for line in res.output.splitlines())
    res = CliRunner().invoke(main, ["select", str(_cfg(tmp_path, docstrings_jsonl, {"name": "first-k", "offset": -1,
                                                                                    "colour": 1})),
                                    "--out", str(tmp_path / "bad")])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "data.select.offset: got -1; expected an integer >= 0" in res.output
    assert "data.select.colour: unknown key" in res.output


def test_a_gradient_rule_on_a_model_without_trainable_weights_names_the_fix():
    from types import SimpleNamespace

    from rankwise.recipes import select as stage
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    sess = SimpleNamespace(model=model, task=None, train_data=[], device="cpu")
    for cfg in (LessConfig(target="t"), InfluenceConfig(target="t"), QCSProxyConfig(target="t")):
        with pytest.raises(RankwiseError, match=rf"^data.select: {cfg.name} needs a model with trainable "
                                                "weights; choose a method such as lora, or data.select.name: "
                                                "embedding or random$"):
            stage.score(sess, cfg, [0, 1], [0], 1)
