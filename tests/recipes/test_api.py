"""``rankwise.train(config, out)``: a dict, a YAML path and a ``RunConfig`` give the run the recipe
gives (same eval_loss to 1e-9, same metrics.json); a finished run returns its metrics; GRPO
rewards may be Python callables (their values are what samples.jsonl records) and
``module:function`` rewards are found next to the config file without PYTHONPATH, also from the
run folder's config.yaml; a config of another type is refused in one line."""
from __future__ import annotations

import json
import sys

import pytest
import yaml

import rankwise
from rankwise.tasks.grpo import rewards as R
from rankwise.tasks.grpo.task import GRPOTask
from rankwise.errors import RankwiseError
from rankwise.recipes.config import load_run_config
from rankwise.recipes.train import train as recipe_train

RAW = {"model": {"path": "tiny-llama", "task": "causal-lm"},
       "data": {"source": "stdlib-functions", "format": "prompt-completion", "max_length": 32, "limit": 12},
       "method": {"name": "lora", "r": 2, "targets": ["q_proj"]},
       "train": {"steps": 2, "batch_size": 4, "eval_batch_size": 8, "progress": False}}


def char_count(prompts, completions, **columns):
    """An importable reward: its name is ``test_api:char_count``."""
    return [float(len(c)) for c in completions]


@pytest.mark.slow
def test_dict_yaml_and_dataclass_give_the_recipe_run(tmp_path):
    expected = recipe_train(load_run_config(None, base=json.loads(json.dumps(RAW))), tmp_path / "recipe")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(RAW))
    for name, config in (("dict", RAW), ("yaml", path), ("dataclass", rankwise.load_config(RAW))):
        metrics = rankwise.train(config, tmp_path / name)
        assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], abs=1e-9), name
        assert json.loads((tmp_path / name / "metrics.json").read_text()) == metrics
    again = rankwise.train(RAW, tmp_path / "dict", resume=True)         # finished: its metrics
    assert again == json.loads((tmp_path / "dict" / "metrics.json").read_text())


@pytest.mark.slow
def test_grpo_rewards_as_python_callables(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"add {i} and {i}", "answer": str(2 * i)}) + "\n"
                               for i in range(6)))
    raw = {"model": {"path": "tiny-llama", "task": "grpo"},
           "data": {"source": str(prompts), "eval_source": str(prompts), "max_length": 16},
           "method": {"name": "lora", "r": 2, "targets": ["q_proj"]},
           "grpo": {"rewards": [lambda prompts, completions, **c: [-float(len(x)) for x in completions],
                                char_count], "num_generations": 2, "max_completion_length": 3},
           "train": {"steps": 1, "batch_size": 2, "eval_batch_size": 6, "progress": False}}
    rankwise.train(raw, tmp_path / "run")
    names = load_run_config(tmp_path / "run" / "config.yaml").task.rewards
    assert names == ["python:test_grpo_rewards_as_python_callables.<locals>.<lambda>", "test_api:char_count"]
    for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines():
        sample = json.loads(line)
        text = sample["completion"]
        assert sample["rewards"] == {names[0]: -float(len(text)), names[1]: float(len(text))}


def test_callable_names_and_their_resolution():
    fa, fb = (lambda p, c, **k: [0.0] * len(c)), (lambda p, c, **k: [1.0] * len(c))
    names = R.name_callables([fa, fb, "exact-match", char_count])
    assert names[0].startswith("python:") and names[1] == names[0] + "#2"
    assert names[2:] == ["exact-match", "test_api:char_count"]
    assert R.resolve(names[1]) is fb and R.resolve(names[3]) is char_count
    with pytest.raises(RankwiseError, match="handed to rankwise.train in another process"):
        R.resolve("python:gone")


def test_module_rewards_are_found_next_to_the_config_and_from_the_run_config(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "project_rewards_mod.py").write_text(
        "def shortness(prompts, completions, **columns):\n    return [-len(c) for c in completions]\n")
    cfg_file = folder / "grpo.yaml"
    cfg_file.write_text(yaml.safe_dump({"model": {"task": "grpo", "path": "tiny-llama"},
                                        "grpo": {"rewards": ["project_rewards_mod:shortness"]}}))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(folder)])
    cfg = load_run_config(cfg_file)
    assert cfg.task.rewards_dir == str(folder.resolve())
    fn = GRPOTask(cfg.task).fns["project_rewards_mod:shortness"]
    assert fn([""], ["abc"]) == [-3]
    run_yaml = tmp_path / "elsewhere" / "config.yaml"                 # a run folder's copy
    run_yaml.parent.mkdir()
    run_yaml.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_run_config(run_yaml).task.rewards_dir == str(folder.resolve())


def test_a_config_of_another_type_is_refused():
    with pytest.raises(RankwiseError, match="config must be a dict, a YAML path or a RunConfig; got int"):
        rankwise.train(3, "out")
