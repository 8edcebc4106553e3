"""Output folders are checked before any work: a file, a path under a file, an unwritable
place, or a folder that holds somebody else's run end with one line and exit 2, untouched."""
import json
import os
import shutil

import pytest
import yaml
from click.testing import CliRunner

from rankwise.cli import main


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line(res, *needles):
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("command", ["compare", "federated", "export"])
def test_out_that_is_a_file_or_under_a_file(tmp_path, tiny_bert_run, command):
    blocker = tmp_path / "blocker"
    blocker.write_text("keep me")
    args = {"compare": ["compare", tiny_bert_run / "config.yaml", "--methods", "lora", "--seeds", "1"],
            "federated": ["federated", tiny_bert_run / "config.yaml"],
            "export": ["export", tiny_bert_run, "--format", "merged"]}[command]
    _one_line(_invoke(*args, "--out", blocker), "is an existing file")
    _one_line(_invoke(*args, "--out", blocker / "sub"), "which is a file")
    assert blocker.read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_out_in_an_unwritable_folder(tmp_path, tiny_bert_run):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    _one_line(_invoke("export", tiny_bert_run, "--format", "merged", "--out", locked / "x"),
              "permission denied")


def test_federated_refuses_a_folder_holding_a_train_run(tmp_path, tiny_bert_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_bert_run, run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["federated"] = {"clients": 2, "rounds": 1}
    (tmp_path / "fed.yaml").write_text(yaml.safe_dump(cfg))
    _one_line(_invoke("federated", tmp_path / "fed.yaml", "--out", run), "holds no federated run")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_compare_never_deletes_a_folder_it_did_not_create(tmp_path, tiny_bert_run):
    out = tmp_path / "cmp"
    foreign = out / "lora" / "seed0"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    _one_line(_invoke("compare", tiny_bert_run / "config.yaml", "--methods", "lora", "--seeds", "1",
                      "--out", out), "not this comparison's")
    assert (foreign / "notes.txt").read_text() == "mine"
    assert json.loads(json.dumps({"ok": True}))
