"""Every bad input a user can produce: exit code 2, one line on stderr naming the fix, no
traceback (unless ``--debug``), and nothing already in the run folder destroyed."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.errors import RankwiseError
from rankwise.testing import error_lines

RANKWISE = str(Path(sys.executable).with_name("rankwise"))
GOOD = {
    "model": {"path": "tiny-bert", "task": "classification"},
    "data": {"source": "demo", "max_length": 16},
    "method": {"name": "lora", "r": 2, "targets": ["query", "value"]},
    "optim": {"name": "adamw", "lr": 0.01},
    "train": {"steps": 2, "batch_size": 4, "progress": False},
}


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def invoke(*args: str):
    """Run ``rankwise ARGS`` in-process."""
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_user_error(result, *needles: str) -> str:
    """Exit 2 via the CLI's handler, one ``error:`` line on stderr containing every needle."""
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit), result.exc_info and "".join(
        traceback.format_exception(*result.exc_info))
    assert result.exit_code == 2, result.output
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def snapshot(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder``."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def train_with(tmp_path: Path, *sets: str, raw: dict | None = None):
    """``rankwise train`` of GOOD (or ``raw``) with ``--set`` overrides into a fresh folder."""
    cfg = write_yaml(tmp_path / "run.yaml", raw or GOOD)
    args = ["train", cfg, "--out", tmp_path / "out"]
    for s in sets:
        args += ["--set", s]
    return invoke(*args)


# --- the config file and --set -------------------------------------------------------------

def test_config_file_missing(tmp_path):
    assert_user_error(invoke("train", tmp_path / "nope.yaml", "--out", tmp_path / "out"),
                      "nope.yaml not found", "YAML run config")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, needles", [
    ("model: {path: tiny-bert\ntrain: [", ("not valid YAML", "line")),
    ("- model\n- train\n", ("must be a YAML mapping", "model, task, data, method")),
    ("trian: {steps: 3}\n", ("unknown section", "did you mean 'train'")),
    ("model: tiny-bert\n", ("model: expected a mapping",)),
], ids=["malformed", "list", "unknown-section", "section-not-mapping"])
def test_bad_yaml(tmp_path, text, needles):
    (tmp_path / "run.yaml").write_text(text)
    assert_user_error(invoke("train", tmp_path / "run.yaml", "--out", tmp_path / "out"), *needles)


@pytest.mark.parametrize("sets, needles", [
    (["method.rr=4"], ("method.rr: unknown key", "did you mean 'r'")),
    (["train.stesp=4"], ("did you mean 'steps'",)),
    (["train.steps=abc"], ("train.steps", "'abc'", "expected an integer")),
    (["train.steps=0"], ("train.steps", "expected an integer >= 1")),
    (["method.use_rslora=maybe"], ("use_rslora", "expected true or false")),
    (["model.task=regression"], ("model.task", "classification")),
    (["train.steps"], ("expected KEY=VALUE", "--set train.steps=100")),
    (["=3"], ("expected KEY=VALUE",)),
    (["method.targets=[query, value"], ("not valid YAML",)),
    (["method.r.x=3"], ("'r' is not a section",)),
    (["method.name=lorra"], ("unknown method 'lorra'", "did you mean 'lora'", "expected one of")),
    (["optim.name=adamm"], ("unknown optimizer 'adamm'", "did you mean 'adamw'")),
    (["train.steps=abc", "method.rr=1"], ("train.steps", "method.rr")),  # all problems at once
], ids=["unknown-key", "unknown-key-2", "bad-type", "bad-value", "bad-bool", "bad-literal",
        "set-no-eq", "set-no-key", "set-bad-yaml", "set-not-section", "unknown-method",
        "unknown-optim", "every-problem"])
def test_bad_config_values(tmp_path, sets, needles):
    assert_user_error(train_with(tmp_path, *sets), *needles)
    assert not (tmp_path / "out").exists()


# --- model and data ------------------------------------------------------------------------

def test_model_path_missing(tmp_path):
    assert_user_error(train_with(tmp_path, f"model.path={tmp_path / 'no-model'}"),
                      "no-model not found", "model.path")


def test_model_folder_without_config_json(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "weights.bin").write_bytes(b"x")
    assert_user_error(train_with(tmp_path, f"model.path={tmp_path / 'm'}"), "no config.json", "save_pretrained")


@pytest.mark.parametrize("name, content, needles", [
    ("missing.csv", None, ("not found", "data.source")),
    ("empty.jsonl", "", ("holds no records",)),
    ("header-only.csv", "text,label\n", ("holds no records",)),
    ("no-text.csv", "body,label\nhello world,a\n", ("no 'text' field", "data.text_field")),
    ("no-label.csv", "text,topic\nhello world,a\n", ("no 'label' field", "data.label_field")),
    ("broken.jsonl", '{"text": "a b", "label": "x"}\n{"text": "c d", "label": \n',
     ("line 2 is not valid JSON", "one JSON object per line")),
    ("list.jsonl", '["text", "label"]\n', ("line 1 is not a JSON object",)),
    ("data.txt", "hello\n", ("extension '.txt'", ".jsonl, .csv or .parquet")),
    ("ragged.csv", "text,label\nhello world,a\n,b,extra,cols\n", ("not valid CSV", "line 3")),
    ("empty-text.jsonl", '{"text": "a b", "label": "x"}\n{"text": "", "label": "y"}\n',
     ("record 2 has an empty 'text' field",)),
], ids=["missing", "empty", "header-only", "no-text-field", "no-label-field", "broken-jsonl",
        "jsonl-not-object", "extension", "ragged-csv", "empty-text"])
def test_bad_data_file(tmp_path, name, content, needles):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert_user_error(train_with(tmp_path, f"data.source={path}"), *needles)
    assert not (tmp_path / "out").exists()


def test_targets_that_match_nothing_list_real_names(tmp_path, docstrings_jsonl):
    line = assert_user_error(train_with(tmp_path, f"data.source={docstrings_jsonl}",
                                        "method.targets=[q_proj,v_proj]"), "matched no module")
    assert "query" in line and "dense" in line and "all-linear" in line


def test_rank_larger_than_layer(tmp_path, docstrings_jsonl):
    # tiny-bert's query/value are 32 -> 32
    assert_user_error(train_with(tmp_path, f"data.source={docstrings_jsonl}", "method.r=64"),
                      "rank 64", "choose r in [1, 32]")


# --- run folders ---------------------------------------------------------------------------

def test_existing_run_folder_is_untouched(tmp_path, tiny_bert_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_bert_run, run)
    before = snapshot(run)
    # a valid config, a config that fails validation later: neither may touch the folder
    assert_user_error(invoke("train", run / "config.yaml", "--out", run), "already holds a run", "--resume")
    assert_user_error(invoke("train", run / "config.yaml", "--out", run, "--set", "train.steps=x"),
                      "train.steps")
    assert_user_error(invoke("train", run / "config.yaml", "--out", run, "--resume",
                             "--set", "data.source=nope.csv"), "config differs", "data.source ('nope.csv' here")
    assert snapshot(run) == before


@pytest.mark.integration
@pytest.mark.slow
def test_installed_console_script(tmp_path, tiny_bert_run):
    """The real ``rankwise`` executable: same exit code, one line, no traceback, folder intact."""
    run = tmp_path / "run"
    shutil.copytree(tiny_bert_run, run)
    before = snapshot(run)
    proc = subprocess.run([RANKWISE, "train", str(run / "config.yaml"), "--out", str(run)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "already holds a run" in lines[0] and "--resume" in lines[0], proc.stderr
    assert snapshot(run) == before


# --- export --------------------------------------------------------------------------------

def test_export_of_a_non_run_folder(tmp_path):
    (tmp_path / "notarun").mkdir()
    assert_user_error(invoke("export", tmp_path / "notarun", "--format", "peft", "--out", tmp_path / "p"),
                      "not a run folder", "--out folder of a finished")
    assert_user_error(invoke("export", tmp_path / "nope", "--format", "merged", "--out", tmp_path / "p"),
                      "not a run folder")
    assert not (tmp_path / "p").exists()


def test_export_to_a_non_empty_out(tmp_path, tiny_bert_run):
    out = tmp_path / "p"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_user_error(invoke("export", tiny_bert_run, "--format", "peft", "--out", out),
                      "is not empty", "choose a new --out")
    assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


def test_export_of_a_corrupt_adapter(tmp_path, tiny_bert_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_bert_run, run)
    weights = run / "adapter" / "adapter.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    before = snapshot(run)
    line = assert_user_error(invoke("export", run, "--format", "peft", "--out", tmp_path / "p"),
                             "adapter.safetensors is missing or corrupt", "--resume")
    assert snapshot(run) == before and not (tmp_path / "p").exists()
    # the fix the message names works: the run's last checkpoint writes the adapter again
    fix = line.split("checkpoint: ")[1].split()
    assert fix[:2] == ["rankwise", "train"]
    assert invoke(*fix[1:]).exit_code == 0
    assert invoke("export", run, "--format", "peft", "--out", tmp_path / "p").exit_code == 0


def test_export_onto_a_mismatched_base(tmp_path, tiny_bert_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_bert_run, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["path"] = "tiny-llama"
    write_yaml(run / "config.yaml", cfg)
    before = snapshot(run)
    assert_user_error(invoke("export", run, "--format", "merged", "--out", tmp_path / "m"),
                      "'tiny-bert'", "'tiny-llama'", "base model it was trained on")
    assert snapshot(run) == before and not (tmp_path / "m").exists()


# --- --debug -------------------------------------------------------------------------------

def test_debug_shows_the_traceback(tmp_path):
    result = invoke("--debug", "train", tmp_path / "nope.yaml")
    assert isinstance(result.exception, RankwiseError) and result.exit_code != 2
    assert "error: " not in result.output  # the one-line handler stepped aside
    tb = "".join(traceback.format_exception(*result.exc_info))
    assert "Traceback" in tb and "read_yaml" in tb


# --- found by trying every subcommand as a new user would ----------------------------------

@pytest.mark.parametrize("sets, needles", [
    (["data.limit=-5"], ["limit: got -5", ">= 1"]),
    (["data.max_length=1000000000000000000000000000000"], ["max_length", "64 bits"]),
    (["data.max_length=100000000"], ["max_length: got 100000000", "expected tokens in 2..16777216"]),
    (["train.seed=10000000000000000000000"], ["train.seed", "64 bits"]),
    (["train.seed=-1"], ["seed: got -1", "expected an integer in 0..4294967295"]),
])
def test_numbers_out_of_range(tmp_path, sets, needles):
    assert_user_error(train_with(tmp_path, *sets), *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_second_train_into_a_folder_in_use_stops_before_loading(tmp_path):
    from rankwise.core.atomic import locked_folder
    out = tmp_path / "out"
    with locked_folder(out):
        assert_user_error(train_with(tmp_path), "in use by another rankwise process",
                          "choose another --out")
        assert sorted(p.name for p in out.iterdir()) == [".rankwise.lock"]
    assert not out.exists()  # the holder created the folder and left nothing in it
    assert train_with(tmp_path).exit_code == 0
    assert not (out / ".rankwise.lock").exists()


def test_out_that_holds_the_base_model_is_refused(tmp_path, tiny_bert_run):
    base = tmp_path / "base"
    assert invoke("export", tiny_bert_run, "--format", "merged", "--out", base).exit_code == 0
    before = snapshot(base)
    raw = {**GOOD, "model": {"path": str(base), "task": "classification"}, "method": {"name": "full"}}
    for out in (base, tmp_path):
        cfg = write_yaml(tmp_path / "full.yaml", raw)
        assert_user_error(invoke("train", cfg, "--out", out), "contains the base model folder",
                          "choose another --out")
    assert snapshot(base) == before


@pytest.mark.slow
def test_a_run_that_failed_before_its_first_checkpoint_does_not_block_its_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # what a run that died at step 1 leaves: its config and log, no checkpoint
    write_yaml(out / "config.yaml", {**GOOD, "optim": {"name": "adamw", "lr": 1.0e6}})
    (out / "events.jsonl").write_text('{"step": 1, "loss": NaN}\n')
    result = train_with(tmp_path, "optim.lr=0.005")
    assert result.exit_code == 0, result.output
    assert "stopped before its first checkpoint" in result.stderr
    assert yaml.safe_load((out / "config.yaml").read_text())["optim"]["lr"] == 0.005


@pytest.mark.slow
def test_resume_survives_a_torn_events_log(tmp_path):
    assert train_with(tmp_path, "train.steps=4", "train.save_every=2", "train.log_every=1").exit_code == 0
    out = tmp_path / "out"
    (out / "metrics.json").unlink()
    shutil.rmtree(sorted(out.glob("checkpoints/*"))[-1])  # back to the step-2 checkpoint
    with open(out / "events.jsonl", "a") as f:
        f.write('{"step": 3, "lo\n\n')  # a write cut short by a crash, then a blank line
    with pytest.warns(UserWarning, match="not a JSON object"):
        result = invoke("train", out / "config.yaml", "--resume", "--out", out)
    assert result.exit_code == 0, result.output
    steps = [e["step"] for e in map(__import__("json").loads, (out / "events.jsonl").read_text().splitlines())
             if "loss" in e]
    assert steps == [1, 2, 3, 4]


def test_frozen_on_a_causal_lm_names_the_real_problem(tmp_path):
    raw = {**GOOD, "model": {"path": "tiny-gpt2", "task": "causal-lm"}, "method": {"name": "frozen"}}
    assert_user_error(train_with(tmp_path, raw=raw), "trains only the task head",
                      "causal-lm model has none", "lora")


def test_a_sequence_classifier_folder_is_not_trained_as_a_causal_lm(tmp_path, tiny_bert_run):
    folder = tmp_path / "classifier"
    assert invoke("export", tiny_bert_run, "--format", "merged", "--out", folder).exit_code == 0
    raw = {**GOOD, "model": {"path": str(folder), "task": "causal-lm"}}
    assert_user_error(train_with(tmp_path, raw=raw), "holds a sequence classifier",
                      "task.name: classification")


def test_a_classifier_folder_with_another_label_count(tmp_path, tiny_bert_run):
    folder = tmp_path / "classifier"
    assert invoke("export", tiny_bert_run, "--format", "merged", "--out", folder).exit_code == 0
    raw = {**GOOD, "model": {"path": str(folder), "task": "classification"}}  # demo: other labels
    assert_user_error(train_with(tmp_path, raw=raw), "another number of labels",
                      "base model's folder")


def test_paths_are_stored_absolute_and_export_takes_a_moved_base(tmp_path, tiny_bert_run, monkeypatch):
    base = tmp_path / "base"
    assert invoke("export", tiny_bert_run, "--format", "merged", "--out", base).exit_code == 0
    monkeypatch.chdir(tmp_path)
    data = yaml.safe_load((tiny_bert_run / "config.yaml").read_text())["data"]["source"]
    raw = {**GOOD, "model": {"path": "base", "task": "classification"},
           "data": {"source": data, "max_length": 16}}
    assert train_with(tmp_path, raw=raw).exit_code == 0
    saved = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert saved["model"]["path"] == str(base.resolve())
    base.rename(tmp_path / "moved")
    assert_user_error(invoke("export", tmp_path / "out", "--format", "peft", "--out", tmp_path / "p"),
                      "not found", "--model PATH")
    result = invoke("export", tmp_path / "out", "--format", "peft", "--out", tmp_path / "p",
                    "--model", tmp_path / "moved")
    assert result.exit_code == 0, result.output


# --- torchrun ------------------------------------------------------------------------------

def test_a_config_error_under_torchrun_prints_on_rank_0_only(tmp_path, monkeypatch):
    """Every process reads the same config, so before joining the process group rank 0 alone
    prints the line; every rank exits 2. Once a process joins, its errors may be its own (a lost
    peer) and it prints them. (The real launch: tests/recipes/test_torchrun.py.)"""
    from rankwise.engine import distributed
    bad = write_yaml(tmp_path / "bad.yaml", {**GOOD, "optim": {"name": "adamw", "lr": -1.0}})
    torchrun_env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    runs = {rank: CliRunner().invoke(main, ["train", str(bad), "--out", str(tmp_path / "run")],
                                     env={**torchrun_env, "RANK": rank, "LOCAL_RANK": rank})
            for rank in ("0", "1")}
    assert_user_error(runs["0"], "optim.lr")
    assert runs["1"].exit_code == 2 and isinstance(runs["1"].exception, SystemExit)
    assert runs["1"].stderr == "" and "Traceback" not in runs["1"].output
    monkeypatch.setattr(distributed, "_JOINING", True)                 # after joining: its own line
    joined = CliRunner().invoke(main, ["train", str(bad), "--out", str(tmp_path / "run")],
                                env={**torchrun_env, "RANK": "1", "LOCAL_RANK": "1"})
    assert_user_error(joined, "optim.lr")
    assert not (tmp_path / "run").exists()
