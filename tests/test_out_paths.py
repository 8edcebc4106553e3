"""Output folders are checked before any work: a file, a path under a file, an unwritable
place, or a folder that holds somebody else's run end with one line and exit 2, untouched."""
import contextlib
import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.testing import error_lines


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line(res, *needles):
    assert res.exit_code == 2, res.output
    lines = error_lines(res.output)
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    for n in needles:
        assert n in lines[0], lines[0]


def _args(command, run, configs):
    """``rankwise COMMAND ...`` up to ``--out`` for each command that writes a folder."""
    return {"train": ["train", configs / "run.yaml"],
            "compare": ["compare", run / "config.yaml", "--methods", "lora", "--seeds", "1"],
            "federated": ["federated", run / "config.yaml"],
            "export": ["export", run, "--format", "merged"],
            "compress": ["compress", configs / "c.yaml"]}[command]


def _configs(folder):
    """A valid train config and a valid compress config (tiny-bert on the demo data) in ``folder``."""
    raw = {"model": {"path": "tiny-bert", "task": "classification"}, "data": {"source": "demo", "max_length": 16},
           "method": {"name": "lora", "r": 2, "targets": ["query", "value"]},
           "train": {"steps": 2, "batch_size": 4, "progress": False}}
    (folder / "run.yaml").write_text(yaml.safe_dump(raw))
    (folder / "c.yaml").write_text(yaml.safe_dump({**raw, "compress": {
        "method": "magnitude", "sparsity": 0.5, "calibration": {"source": "data", "sequences": 2, "length": 8}}}))
    return folder


COMMANDS = ["train", "compare", "federated", "export", "compress"]


@pytest.mark.parametrize("command", COMMANDS)
def test_out_that_is_a_file_or_under_a_file(tmp_path, tiny_bert_run, command):
    blocker = tmp_path / "blocker"
    blocker.write_text("keep me")
    args = _args(command, tiny_bert_run, _configs(tmp_path))
    _one_line(_invoke(*args, "--out", blocker), "is an existing file")
    _one_line(_invoke(*args, "--out", blocker / "sub"), "which is a file")
    assert blocker.read_text() == "keep me"


def test_generate_paths_that_are_files(tmp_path, tiny_bert_run):
    """generate writes no folder (no --out); the folders it reads, given as files, are one line."""
    blocker = tmp_path / "blocker"
    blocker.write_text("keep me")
    _one_line(_invoke("generate", blocker, "--prompt", "hi"), "not a run folder")
    _one_line(_invoke("generate", blocker / "sub", "--prompt", "hi"), "not a run folder")
    _one_line(_invoke("generate", tiny_bert_run, "--prompt", "hi", "--adapter", blocker), "causal-lm")
    assert blocker.read_text() == "keep me"


@contextlib.contextmanager
def _as_a_user():
    """Run the block without root's right to write anywhere: as root (CI) drop real and
    effective uid/gid to nobody (65534), keeping the saved uid 0 to come back; as a user, do
    nothing."""
    if os.geteuid() != 0:
        yield
        return
    os.setresgid(65534, 65534, 0)
    os.setresuid(65534, 65534, 0)
    try:
        yield
    finally:
        os.setresuid(0, 0, 0)
        os.setresgid(0, 0, 0)


@pytest.mark.parametrize("command", COMMANDS)
def test_out_in_an_unwritable_or_unsearchable_folder(tiny_bert_run, command):
    for module in ("rankwise.federated.run", "rankwise.commands.compare.run", "rankwise.recipes.compress",
                   "rankwise.recipes.export", "rankwise.recipes.train"):
        importlib.import_module(module)  # while every file is readable
    shared = Path(tempfile.mkdtemp())  # pytest's tmp_path is private to its owner (0700)
    try:
        shared.chmod(0o755)
        args = _args(command, tiny_bert_run, _configs(shared))
        (shared / "locked").mkdir(mode=0o555)   # readable, not writable
        (shared / "hidden").mkdir(mode=0o000)   # not even searchable
        with _as_a_user():
            assert not os.access(shared / "locked", os.W_OK)
            locked = _invoke(*args, "--out", shared / "locked" / "x")
            hidden = _invoke(*args, "--out", shared / "hidden" / "x")
        _one_line(locked, "permission denied", "choose a folder you can write to")
        _one_line(hidden, "permission denied", "choose a folder you can write to")
        assert sorted(p.name for p in (shared / "locked").iterdir()) == []
    finally:
        (shared / "hidden").chmod(0o700)
        shutil.rmtree(shared)


def test_federated_refuses_a_folder_holding_a_train_run(tmp_path, tiny_bert_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_bert_run, run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    from rankwise.federated.task import NOT_FOLLOWED
    cfg["train"] = {k: v for k, v in cfg["train"].items() if k not in NOT_FOLLOWED}  # a valid federated config
    cfg["federated"] = {"clients": 2, "rounds": 1}
    (tmp_path / "fed.yaml").write_text(yaml.safe_dump(cfg))
    _one_line(_invoke("federated", tmp_path / "fed.yaml", "--out", run), "holds no federated run")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_compare_never_deletes_a_folder_it_did_not_create(tmp_path, tiny_bert_run):
    out = tmp_path / "cmp"
    foreign = out / "lora" / "seed0"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    args = ["compare", tiny_bert_run / "config.yaml", "--methods", "lora", "--seeds", "1", "--out", out]
    _one_line(_invoke(*args), "not a comparison", "choose another --out")
    (out / "rankwise.json").write_text('{"kind": "compare"}')  # an earlier comparison's folder
    _one_line(_invoke(*args), "not this comparison's")
    assert (foreign / "notes.txt").read_text() == "mine"
    assert json.loads(json.dumps({"ok": True}))
