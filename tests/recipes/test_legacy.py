"""The old spelling of the task (``model.task`` + ``dpo:`` / ``grpo:`` / ``memory_decoder:``) is
read for one release with a one-line notice, and resolves to the same config as ``task:``."""
from __future__ import annotations

import pytest
import yaml

from rankwise.errors import RankwiseError
from rankwise.recipes import legacy
from rankwise.recipes.config import build_run_config, load_run_config
from rankwise.recipes.runs import config_hash

LLAMA = {"path": "tiny-llama"}


@pytest.mark.parametrize("old, new", [
    ({"model": {**LLAMA, "task": "dpo"}, "dpo": {"beta": 0.2}}, {"name": "dpo", "beta": 0.2}),
    ({"model": {**LLAMA, "task": "grpo"}}, {"name": "grpo"}),
    ({"model": {**LLAMA, "task": "causal-lm"}}, {"name": "causal-lm"}),
    ({"model": LLAMA, "grpo": None}, {"name": "classification"}),
])
def test_the_old_spelling_resolves_as_the_new_one_and_hashes_alike(old, new):
    spelling = legacy.translate(old)
    assert spelling.data["task"] == new and "task" not in spelling.data["model"]
    assert not spelling.problems
    if "beta" in new or new["name"] == "grpo":
        assert spelling.notice.startswith("notice: model.task") and "\n" not in spelling.notice
        assert f"write task: {{name: {new['name']}" in spelling.notice
    now = {"model": LLAMA, "task": new}
    assert build_run_config(old, notice=False).to_dict() == build_run_config(now).to_dict()
    assert config_hash(old) == config_hash(now)


def test_a_classification_run_hashes_as_before_the_task_section():
    old = {"model": {"path": "demo", "task": "classification"}}
    resolved = build_run_config(old, notice=False).to_dict()
    assert resolved["task"] == {"name": "classification"} and "task" not in resolved["model"]
    shaped = legacy.old_shape(resolved)
    assert shaped["model"]["task"] == "classification" and "task" not in shaped
    assert config_hash(old) == config_hash({"model": {"path": "demo"}})


def test_the_notice_is_one_line_on_stderr_once(capsys, monkeypatch):
    monkeypatch.setattr(legacy, "_SHOWN", set())
    for _ in range(2):
        build_run_config({"model": {**LLAMA, "task": "dpo"}, "dpo": {"beta": 0.3}})
    err = capsys.readouterr().err.splitlines()
    assert err == ["notice: model.task and the dpo: section are the old spelling, read until the next "
                   "release; write task: {name: dpo, beta: 0.3}"]
    build_run_config({"model": LLAMA, "task": {"name": "dpo", "beta": 0.3}})
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("raw, needle", [
    ({"model": {**LLAMA, "task": "causal-lm"}, "dpo": {"beta": 0.2}}, "the dpo section needs model.task: dpo"),
    ({"model": {**LLAMA, "task": "dpo"}, "task": {"name": "dpo"}}, "which this config also has"),
    ({"model": {**LLAMA, "task": "dpo"}, "dpo": 3}, "dpo: expected a mapping"),
    ({"model": {**LLAMA, "task": "dpoo"}}, "model.task: unknown task 'dpoo'"),
    ({"model": {**LLAMA, "task": "dpo"}, "dpo": {"betta": 1}}, "dpo.betta"),
    ({"model": LLAMA, "task": {"name": "dpo", "betta": 1}}, "task.betta"),
    ({"model": LLAMA, "task": {"name": "memory-decoder"}}, "task.base: empty"),
])
def test_mistakes_in_either_spelling_name_the_key_the_user_wrote(raw, needle):
    with pytest.raises(RankwiseError) as err:
        build_run_config(raw, notice=False)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_task_path_is_read_from_the_config_folder_in_both_spellings(tmp_path):
    (tmp_path / "base").mkdir()
    for i, raw in enumerate([{"model": {**LLAMA, "task": "memory-decoder"}, "memory_decoder": {"base": "base"}},
                             {"model": LLAMA, "task": {"name": "memory-decoder", "base": "base"}}]):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(yaml.safe_dump(raw))
        assert load_run_config(path, notice=False).task.base == str((tmp_path / "base").resolve())


@pytest.mark.parametrize("old, new", [
    ({"kind": "nsnquant", "bits": 1, "chunk": 8}, {"name": "nsnquant", "bits": 1, "chunk": 8}),
    ({"kind": "kivi", "bits": 4}, {"name": "kivi", "bits": 4}),
    ({"kind": "fp", "bits": 2, "chunk": 16}, {"name": "fp"}),      # fp ignored them: left out
    ({"kind": "none", "bits": 2, "chunk": 16}, None),              # the old default: no cache
])
def test_the_old_kv_cache_spelling_reads_as_the_new_one_with_a_one_line_notice(old, new, capsys, monkeypatch):
    monkeypatch.setattr(legacy, "_SHOWN", set())
    raw = lambda kv: {"model": LLAMA, "compress": {"method": "none", "kv_cache": kv}}  # noqa: E731
    assert build_run_config(raw(old)).to_dict() == build_run_config(raw(new)).to_dict()
    err = capsys.readouterr().err.splitlines()
    text = "null (or leave it out)" if new is None else yaml.safe_dump(new, default_flow_style=True,
                                                                        sort_keys=False).strip()
    assert err == ["notice: compress.kv_cache.kind is the old spelling, read until the next release; "
                   f"write compress.kv_cache: {text}"]
    build_run_config(raw(new))
    assert capsys.readouterr().err == ""


def test_an_unknown_kv_cache_name_in_either_spelling_says_did_you_mean():
    for kv in ({"name": "nsnqant"}, {"kind": "nsnqant"}):
        with pytest.raises(RankwiseError, match=r"compress.kv_cache.name: got 'nsnqant'; expected one of "
                                                r"\['fp', 'kivi', 'nsnquant'\] \(did you mean 'nsnquant'\?\)"):
            build_run_config({"model": LLAMA, "compress": {"method": "none", "kv_cache": kv}}, notice=False)


GRPO_DATA = {"source": "stdlib-functions", "format": "prompt-completion"}


@pytest.mark.parametrize("old, new, notice", [
    ({"model": LLAMA, "data": {"schedule": "skrull", "schedule_linear": 96.0, "schedule_bucket": 512}},
     {"model": LLAMA, "data": {"schedule": {"name": "skrull", "linear": 96.0, "bucket": 512}}},
     "notice: data.schedule_linear and data.schedule_bucket are the old spelling of data.schedule: "
     "{name: skrull, linear: 96.0, bucket: 512}; read until the next release"),
    ({"model": LLAMA, "task": {"name": "grpo", "gain_rl": {"pool": 4}}, "data": {**GRPO_DATA, "order": "gain-rl"}},
     {"model": LLAMA, "task": {"name": "grpo"}, "data": {**GRPO_DATA, "order": {"name": "gain-rl", "pool": 4}}},
     "notice: task.gain_rl is the old spelling of data.order: {name: gain-rl, pool: 4}; read until the next release"),
    ({"model": {**LLAMA, "task": "grpo"}, "grpo": {"gain_rl": {"pool": 4}}, "data": GRPO_DATA},
     {"model": LLAMA, "task": {"name": "grpo"}, "data": GRPO_DATA},
     "without data.order: gain-rl it has no effect; it is left out"),
])
def test_the_old_schedule_and_order_keys_resolve_as_the_new_ones_and_hash_alike(old, new, notice,
                                                                                capsys, monkeypatch):
    monkeypatch.setattr(legacy, "_SHOWN", set())
    assert build_run_config(old).to_dict() == build_run_config(new).to_dict()
    err = [line for line in capsys.readouterr().err.splitlines() if "task.gain_rl" in line or "schedule" in line]
    assert len(err) == 1 and notice in err[0]
    assert config_hash(old) == config_hash(new)


def test_a_grpo_run_hashes_as_when_gain_rl_was_a_task_key():
    """Before the order kind a GRPO run's resolved config held ``grpo.gain_rl`` (its defaults
    under a uniform order): the old layout of today's config has them back, so its hash is
    that of a run recorded then."""
    shaped = legacy.old_shape(build_run_config({"model": LLAMA, "task": {"name": "grpo"},
                                                "data": GRPO_DATA}).to_dict())
    assert shaped["data"]["order"] == "uniform" and shaped["data"]["schedule"] == "none"
    assert shaped["grpo"]["gain_rl"] == {"prefix_tokens": 0, "tail_tokens": 0, "inter_weight": 8.0,
                                         "reading": "pairs", "pool": 256, "sigma": 0.1333, "move": 0.0667,
                                         "reward_max": 1.0}
    shaped = legacy.old_shape(build_run_config({"model": LLAMA, "task": {"name": "grpo"}, "data": {
        **GRPO_DATA, "order": {"name": "gain-rl", "pool": 8}}}).to_dict())
    assert shaped["data"]["order"] == "gain-rl" and shaped["grpo"]["gain_rl"]["pool"] == 8
