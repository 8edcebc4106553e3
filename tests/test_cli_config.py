"""What a config file and ``--set`` mean, as ``rankwise`` reads them: numbers as people write
them (YAML 1.2: ``1e-3`` is a float, ``2:4`` is text), no silently repeated keys, no silently
empty file, and a hint to quote a Jinja template (issue 18, items 7, 8 and 15)."""
from __future__ import annotations

import json

import pytest
import yaml

from rankwise.recipes.compress import load_config
from rankwise.recipes.config import load_run_config
from rankwise.recipes.yamlfile import dump, load
from test_cli_errors import GOOD, assert_user_error, invoke, train_with


@pytest.mark.parametrize("text, value", [
    ("1e-3", 1e-3), ("5e-3", 5e-3), ("-2E+4", -2e4), ("1.0e-05", 1e-5), (".5", 0.5), ("3.", 3.0),
    ("1_000", 1000), ("0x1f", 31), ("-7", -7), (".inf", float("inf")),
    ("2:4", "2:4"), ("1:30", "1:30"), ("190:20:30", "190:20:30"), (".", "."), ("1e", "1e"),
    ("true", True), ("null", None),
])
def test_scalars_follow_yaml_1_2(text, value):
    got = load(text)
    assert got == value and type(got) is type(value), (text, got)


@pytest.mark.slow  # a training run through the CLI
def test_lr_written_with_an_exponent_trains(tmp_path):
    """``lr: 5e-3`` in the file and ``--set optim.lr=1e-3`` both reach the run as floats."""
    raw = yaml.safe_load(yaml.safe_dump(GOOD))
    cfg_text = yaml.safe_dump(raw, sort_keys=False).replace("lr: 0.01", "lr: 5e-3")
    assert "lr: 5e-3" in cfg_text
    (tmp_path / "run.yaml").write_text(cfg_text)
    ok = invoke("train", tmp_path / "run.yaml", "--out", tmp_path / "a", "--set", "train.steps=1")
    assert ok.exit_code == 0, ok.output
    assert yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())["optim"]["lr"] == 0.005
    ok = invoke("train", tmp_path / "run.yaml", "--out", tmp_path / "b", "--set", "train.steps=1",
                "--set", "optim.lr=1e-3")
    assert ok.exit_code == 0, ok.output
    assert yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())["optim"]["lr"] == 0.001


def test_nm_pattern_stays_text(tmp_path):
    """``--set compress.pattern=2:4`` is the pattern 2:4, not the base-60 integer 124."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "tiny-llama", "task": "causal-lm"},
                                    "compress": {"method": "wanda"}}))
    _, ccfg, raw = load_config(path, ["compress.pattern=2:4"])
    assert raw["compress"]["pattern"] == "2:4" and ccfg.nm == (2, 4)
    path.write_text("model: {path: tiny-llama, task: causal-lm}\ncompress: {method: wanda, pattern: 2:4}\n")
    assert load_config(path, [])[1].nm == (2, 4)


def test_a_duplicate_section_names_both_lines(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "model: {path: tiny-bert}\n"
        "data:\n  source: demo\n  max_length: 16\n"
        "train: {steps: 1}\n"
        "data:\n  limit: 10\n")
    line = assert_user_error(invoke("train", tmp_path / "run.yaml", "--out", tmp_path / "out"),
                             "run.yaml line 6", "duplicate key 'data'", "first at line 2")
    assert "keep one" in line
    assert not (tmp_path / "out").exists()


def test_a_duplicate_key_inside_a_section_and_in_set(tmp_path):
    (tmp_path / "run.yaml").write_text("model: {path: tiny-bert}\ntrain:\n  steps: 1\n  seed: 1\n  steps: 3\n")
    assert_user_error(invoke("train", tmp_path / "run.yaml", "--out", tmp_path / "out"),
                      "line 5", "duplicate key 'steps'", "first at line 3")
    assert_user_error(train_with(tmp_path, "train={steps: 1, steps: 2}"),
                      "--set 'train={steps: 1, steps: 2}'", "duplicate key 'steps'")
    # a merge key may still be overridden, as YAML intends; repeating --set is an override too
    data = load("base: &b {steps: 1, seed: 2}\ntrain: {<<: *b, steps: 5}\n")
    assert data["train"] == {"steps": 5, "seed": 2}
    cfg = load_run_config(None, ["train.steps=4", "train.steps=6"], base={})
    assert cfg.train.steps == 6


def test_an_empty_config_is_refused(tmp_path):
    for text in ("", "\n# only a comment\n"):
        (tmp_path / "empty.yaml").write_text(text)
        assert_user_error(invoke("train", tmp_path / "empty.yaml", "--out", tmp_path / "out"),
                          "empty.yaml is empty", "model")
        assert not (tmp_path / "out").exists()


def test_an_unquoted_jinja_template_says_to_quote_it(tmp_path):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    line = assert_user_error(train_with(tmp_path, f"data.chat_template={template}"),
                             "not valid YAML", "Jinja template must be quoted",
                             "data.chat_template='...'")
    assert "file" in line
    # quoted as the message says, it is read as the template itself
    cfg = load_run_config(None, [f"data.chat_template='{template}'"], base={})
    assert cfg.data.chat_template == template
    assert_user_error(train_with(tmp_path, "method.targets=[query, value"), "not valid YAML",
                      "quote it")


@pytest.mark.slow  # a training run through the CLI
def test_a_run_folder_config_reads_back_identically(tmp_path):
    """config.yaml is written so that rankwise (YAML 1.2 numbers) and a YAML 1.1 reader such as
    ``yaml.safe_load`` both read back what was written: text that looks like a number is quoted."""
    raw = json.loads(json.dumps(GOOD))
    raw["data"]["text_field"] = "1e-3"  # a column may be named anything
    raw["optim"]["lr"] = 1e-5
    cfg = load_run_config(None, base=raw)
    text = dump(cfg.to_dict(), sort_keys=False)
    assert "text_field: '1e-3'" in text
    assert load(text) == yaml.safe_load(text) == cfg.to_dict()
    assert dump({"p": "2:4"}) == "p: '2:4'\n"
    ok = train_with(tmp_path, "train.steps=1", "optim.lr=1e-5")
    assert ok.exit_code == 0, ok.output
    again = load_run_config(tmp_path / "out" / "config.yaml")
    assert again.optim.lr == 1e-5 and again.to_dict()["train"]["steps"] == 1
