"""Relative paths in a config file are read from its folder, ``--set`` values from the current
directory, built-in names stay names (issue 32, item 12; the rule: ``recipes/paths.py``)."""
from __future__ import annotations

from pathlib import Path

import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.recipes.config import load_run_config
from rankwise.commands.distill.run import read_config

REPO = Path(__file__).resolve().parents[2]


def _layout(tmp_path: Path, monkeypatch, raw: dict) -> Path:
    """``tmp/configs/run.yaml`` with ``raw``, and ``tmp/work`` as the current directory."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "work").mkdir()
    path = tmp_path / "configs" / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path / "work")
    return path


def test_a_config_files_relative_paths_are_read_from_its_folder(tmp_path, monkeypatch):
    path = _layout(tmp_path, monkeypatch, {
        "model": {"path": "base"}, "data": {"source": "data/train.jsonl", "eval_source": "../eval.jsonl",
                                            "chat_template": "chat.jinja"},
        "memory_decoder": {"base": "base"}})
    (tmp_path / "configs" / "base").mkdir()
    (tmp_path / "configs" / "data").mkdir()
    for f in ("configs/data/train.jsonl", "eval.jsonl", "configs/chat.jinja"):
        (tmp_path / f).write_text("")
    from rankwise.recipes.config import read_yaml
    got = read_yaml(path)
    assert got["model"]["path"] == got["memory_decoder"]["base"] == str(tmp_path / "configs" / "base")
    assert got["data"]["source"] == str(tmp_path / "configs" / "data" / "train.jsonl")
    assert got["data"]["eval_source"] == "../eval.jsonl"  # configs/.. = work/..: the same file, as written
    assert got["data"]["chat_template"] == str(tmp_path / "configs" / "chat.jinja")


def test_built_in_names_stay_names_even_beside_a_folder_of_that_name(tmp_path, monkeypatch):
    jinja = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    raw = {"model": {"path": "demo"}, "data": {"source": "stdlib-functions", "chat_template": jinja,
                                                "select": {"name": "less", "target": "demo:email"}},
           "compress": {"method": "magnitude", "calibration": {"source": "stdlib"},
                        "heldout": {"source": "data"}}}
    path = _layout(tmp_path, monkeypatch, raw)
    for name in ("demo", "stdlib-functions", "stdlib", "data", "tiny-llama"):
        (tmp_path / "configs" / name).mkdir()
    from rankwise.recipes.config import read_yaml
    assert read_yaml(path) == raw
    for model in ("tiny-llama", "tiny-bert"):
        raw["model"]["path"] = model
        path.write_text(yaml.safe_dump(raw))
        assert read_yaml(path)["model"]["path"] == model
    path.write_text(yaml.safe_dump({"model": {"path": "demo"}, "data": {"source": "demo"}}))
    cfg = load_run_config(path)  # the whole config validates with them
    assert (cfg.model.path, cfg.data.source) == ("demo", "demo")


def test_set_values_are_read_from_the_current_directory(tmp_path, monkeypatch, docstrings_jsonl):
    path = _layout(tmp_path, monkeypatch, {"model": {"path": "tiny-bert"}, "data": {"source": "pets.jsonl"}})
    (tmp_path / "configs" / "pets.jsonl").write_text(docstrings_jsonl.read_text())
    (tmp_path / "work" / "pets.jsonl").write_text(docstrings_jsonl.read_text())
    assert load_run_config(path).data.source == str(tmp_path / "configs" / "pets.jsonl")
    cfg = load_run_config(path, ["data.source=pets.jsonl"])
    assert cfg.data.source == str(tmp_path / "work" / "pets.jsonl")  # the command line's folder


def test_older_configs_written_for_the_current_directory_still_work(tmp_path, monkeypatch):
    path = _layout(tmp_path, monkeypatch, {"model": {"path": "tiny-bert"}, "data": {"source": "cwd.jsonl"}})
    (tmp_path / "work" / "cwd.jsonl").write_text('{"text": "a", "label": "x"}\n')
    assert load_run_config(path).data.source == str(tmp_path / "work" / "cwd.jsonl")
    # a config in the current directory: its values are left as written (compare's plans keep them)
    (tmp_path / "work" / "here.yaml").write_text(yaml.safe_dump({"data": {"source": "cwd.jsonl"}}))
    from rankwise.recipes.config import read_yaml
    assert read_yaml(tmp_path / "work" / "here.yaml") == {"data": {"source": "cwd.jsonl"}}


def test_a_path_found_nowhere_is_named_inside_the_configs_folder(tmp_path, monkeypatch):
    path = _layout(tmp_path, monkeypatch, {"model": {"path": "tiny-bert"}, "data": {"source": "missing.jsonl"}})
    res = CliRunner().invoke(main, ["train", str(path), "--out", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    line = res.stderr.strip()
    assert f"data file {tmp_path / 'configs' / 'missing.jsonl'} not found" in line, line
    assert "read from the config file's folder, --set values from the current directory" in line
    assert not (tmp_path / "run").exists()


def test_distill_configs_follow_the_same_rule(tmp_path, monkeypatch):
    path = _layout(tmp_path, monkeypatch, {"data": {"source": "corpus.txt"}, "heldout": {"source": "stdlib-heldout"}})
    (tmp_path / "configs" / "corpus.txt").write_text("text")
    cfg = read_config(path, [], 8)
    assert (cfg.data.source, cfg.heldout.source) == (str(tmp_path / "configs" / "corpus.txt"), "stdlib-heldout")


def test_the_plan_example_runs_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["plan", str(REPO / "examples" / "plan-llama3-8b-qlora.yaml"),
                                    "--json"])
    assert res.exit_code == 0, res.output
    assert '"trainable_params": 41943040' in res.output
