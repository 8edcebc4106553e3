"""No command loses or mixes data in a folder it did not write (issue 18, items 1-3).

Each run folder records its kind (``rankwise.json``); every command refuses a folder of
another kind with one line and exit 2, ``--overwrite`` replaces only compress's own files, and
every file that existed before a refused command is byte-identical after it.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.testing import error_lines

SMALL = {"calibration": {"sequences": 4, "length": 16}, "heldout": {"sequences": 4, "length": 16}}


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line(res, *needles) -> str:
    assert res.exit_code == 2, res.output
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def tree(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder`` (hidden ones included)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A tiny Llama saved with ``save_pretrained`` (a base model folder compress can read)."""
    from rankwise.recipes.model import load_model
    folder = tmp_path_factory.mktemp("llama") / "base"
    model, tok = load_model("tiny-llama", "causal-lm")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def compress_cfg(tmp_path: Path, model_path) -> Path:
    return write_yaml(tmp_path / "c.yaml", {"model": {"path": str(model_path), "task": "causal-lm"},
                                            "compress": {"method": "magnitude", "sparsity": 0.5, **SMALL}})


def fed_run(tmp_path: Path, tiny_bert_run: Path, record: bool) -> Path:
    """What ``rankwise federated`` leaves: config.yaml (with its federated section),
    rounds.jsonl, metrics.json, results.md (and, since this change, its record)."""
    run = tmp_path / "fed"
    run.mkdir()
    cfg = yaml.safe_load((tiny_bert_run / "config.yaml").read_text())
    cfg["federated"] = {"clients": 2, "rounds": 1}
    write_yaml(run / "config.yaml", cfg)
    (run / "rounds.jsonl").write_text('{"round": 0, "eval_accuracy": 0.25}\n{"round": 1, "eval_accuracy": 0.5}\n')
    (run / "metrics.json").write_text(json.dumps({"eval_accuracy": 0.5, "rounds": 1, "strategy": "fedavg"}))
    (run / "results.md").write_text("| run |\n")
    if record:
        (run / "rankwise.json").write_text('{"kind": "federated"}')
    return run


# --- 1. compress --overwrite ---------------------------------------------------------------

def test_compress_never_replaces_the_folder_that_holds_its_input(tmp_path, llama_folder):
    ow = tmp_path / "ow"
    shutil.copytree(llama_folder, ow / "basecopy")
    (ow / "notes.txt").write_text("mine")
    before = tree(ow)
    cfg = compress_cfg(tmp_path, ow / "basecopy")
    for out in (ow, ow / "basecopy"):
        for flags in ((), ("--overwrite",)):
            one_line(invoke("compress", cfg, "--out", out, *flags), "contains model.path",
                     "choose another --out")
    assert tree(ow) == before


def test_compress_never_replaces_the_run_it_compresses(tmp_path, tiny_bert_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_bert_run, run)
    before = tree(run)
    cfg = write_yaml(tmp_path / "c.yaml", {"model": {"path": str(run)}, "compress": {
        "method": "magnitude", "sparsity": 0.5, "calibration": {"source": "data", "sequences": 4, "length": 16}}})
    one_line(invoke("compress", cfg, "--out", run, "--overwrite"), "contains model.path")
    assert tree(run) == before


def test_overwrite_replaces_only_what_compress_wrote(tmp_path, llama_folder, tiny_bert_run):
    cfg = compress_cfg(tmp_path, llama_folder)
    out = tmp_path / "out"
    assert invoke("compress", cfg, "--out", out).exit_code == 0
    written = json.loads((out / "rankwise.json").read_text())
    assert written["kind"] == "compress"
    assert set(written["files"]) == set(tree(out)) - {"rankwise.json"}
    assert {"model.safetensors", "compression.safetensors", "report.json"} <= set(written["files"])
    # a file of the user's in it: --overwrite would delete it, so it refuses
    (out / "notes.txt").write_text("mine")
    before = tree(out)
    one_line(invoke("compress", cfg, "--out", out, "--overwrite"), "notes.txt", "compress did not write")
    assert tree(out) == before
    (out / "notes.txt").unlink()
    res = invoke("compress", cfg, "--out", out, "--overwrite")
    assert res.exit_code == 0, res.output
    assert set(tree(out)) == set(written["files"]) | {"rankwise.json"}
    # other kinds of folder are never replaced, --overwrite or not
    run = tmp_path / "run"
    shutil.copytree(tiny_bert_run, run)
    before = tree(run)
    one_line(invoke("compress", cfg, "--out", run, "--overwrite"), "holds a train run", "choose another --out")
    assert tree(run) == before


def test_overwrite_of_an_unrecorded_compress_output_is_refused(tmp_path, llama_folder):
    cfg = compress_cfg(tmp_path, llama_folder)
    out = tmp_path / "out"
    assert invoke("compress", cfg, "--out", out).exit_code == 0
    (out / "rankwise.json").unlink()  # as written before compress recorded its files
    before = tree(out)
    one_line(invoke("compress", cfg, "--out", out, "--overwrite"), "delete it yourself")
    assert tree(out) == before


# --- 2. every command refuses a folder of another kind ---------------------------------------

@pytest.mark.parametrize("record", [True, False], ids=["recorded", "older-folder"])
def test_train_refuses_a_federated_run_and_suggests_nothing_that_would_write_there(
        tmp_path, tiny_bert_run, record):
    fed = fed_run(tmp_path, tiny_bert_run, record)
    before = tree(fed)
    for flags in (("--resume",), ()):
        line = one_line(invoke("train", fed / "config.yaml", "--out", fed, *flags),
                        "holds a federated run", "choose another --out")
        assert "--resume" not in line and "config.yaml" not in line  # no command that writes there
    assert tree(fed) == before
    # an interrupted federated run: the message names the command that continues it, federated's
    (fed / "metrics.json").unlink()
    before = tree(fed)
    line = one_line(invoke("train", fed / "config.yaml", "--out", fed, "--resume"), "holds a federated run")
    assert f"rankwise federated {fed / 'config.yaml'} --out {fed} --resume" in line
    assert "rankwise train" not in line.replace("(rankwise train)", "")
    assert tree(fed) == before


def test_export_and_generate_refuse_a_federated_run(tmp_path, tiny_bert_run):
    fed = fed_run(tmp_path, tiny_bert_run, record=True)
    before = tree(fed)
    one_line(invoke("export", fed, "--format", "peft", "--out", tmp_path / "x"), "holds a federated run")
    one_line(invoke("generate", fed, "--prompt", "hi"), "holds a federated run")
    assert tree(fed) == before and not (tmp_path / "x").exists()


def test_a_train_run_records_its_kind(tiny_bert_run):
    assert json.loads((tiny_bert_run / "rankwise.json").read_text()) == {"kind": "train"}


def test_federated_compare_and_demo_refuse_a_train_run(tmp_path, tiny_bert_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_bert_run, run)
    before = tree(run)
    raw = yaml.safe_load((run / "config.yaml").read_text())
    from rankwise.federated.task import NOT_FOLLOWED
    raw["train"] = {k: v for k, v in raw["train"].items() if k not in NOT_FOLLOWED}  # a valid federated config
    fed = write_yaml(tmp_path / "fed.yaml", {**raw, "federated": {"clients": 2, "rounds": 1}})
    one_line(invoke("federated", fed, "--out", run), "holds a train run")
    one_line(invoke("compare", run / "config.yaml", "--methods", "lora", "--seeds", "1", "--out", run),
             "holds a train run", "choose another --out")
    one_line(invoke("demo", "--out", run), "holds a train run", "choose another --out")
    assert tree(run) == before


def test_demo_never_deletes_a_run_folder_of_another_kind(tmp_path, tiny_bert_run):
    demo = tmp_path / "demo"
    (demo / "lora").mkdir(parents=True)
    (demo / "lora" / "notes.txt").write_text("mine")
    (demo / "rankwise.json").write_text('{"kind": "demo"}')
    before = tree(demo)
    one_line(invoke("demo", "--out", demo), "demo run folder", "lora")
    assert tree(demo) == before


# --- 3. train onto a folder that is not a train run --------------------------------------------

@pytest.fixture(scope="module")
def foreign_folders(tmp_path_factory, tiny_bert_run) -> dict[str, Path]:
    """Non-empty folders that are not train runs: exports, a comparison, the demo's output,
    a compress output and a folder of somebody's files."""
    root = tmp_path_factory.mktemp("foreign")
    out = {}
    for fmt in ("peft", "merged", "rankwise"):
        out[fmt] = root / fmt
        assert invoke("export", tiny_bert_run, "--format", fmt, "--out", out[fmt]).exit_code == 0
    cmp = out["compare"] = root / "cmp"
    shutil.copytree(tiny_bert_run, cmp / "lora" / "seed0")
    (cmp / "lora" / "seed0" / "compare_plan.json").write_text("{}")
    (cmp / "results.json").write_text("{}")
    demo = out["demo"] = root / "demo"
    for name in ("frozen", "lora"):
        shutil.copytree(tiny_bert_run, demo / name)
    (demo / "summary.json").write_text("{}")
    (demo / "learning_curve.png").write_bytes(b"png")
    comp = out["compress"] = root / "comp"
    comp.mkdir()
    for name in ("config.json", "model.safetensors", "compression.safetensors", "report.json"):
        (comp / name).write_text("{}")
    mine = out["other"] = root / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("mine")
    return out


@pytest.mark.parametrize("kind,needle", [
    ("peft", "PEFT adapter"), ("merged", "transformers model folder"), ("rankwise", "rankwise adapter"),
    ("compare", "comparison"), ("demo", "the demo's output"), ("compress", "compress output"),
    ("other", "files that no rankwise command wrote"),
])
@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_train_refuses_a_folder_that_is_not_a_train_run(tmp_path, tiny_bert_run, foreign_folders,
                                                        kind, needle, resume):
    folder = tmp_path / kind
    shutil.copytree(foreign_folders[kind], folder)
    before = tree(folder)
    one_line(invoke("train", tiny_bert_run / "config.yaml", "--out", folder, *(["--resume"] if resume else [])),
             needle, "not a train run", "choose another --out")
    assert tree(folder) == before
