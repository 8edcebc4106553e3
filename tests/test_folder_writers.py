"""select, inspect, merge, distill and vfl never write into a folder they did not write
(issue 32, items 1-2): each records its kind (``rankwise.json``) and refuses another command's
output or a folder of the user's own files with one line and exit 2, every file there
byte-identical after the command. (train, compare, compress, federated, demo:
``tests/test_folder_kinds.py``.)
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from rankwise.recipes import folders
from test_folder_kinds import invoke, one_line, tree  # the checks every folder-writing command shares


def _write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


# What the user found overwritten: their own select-like and report files, a train run,
# a compress output; plus each new kind's folder, which the other commands must refuse too.
FOREIGN = {
    "mine-select": ({"scores.jsonl": '{"id": "a", "score": 1}\n', "chosen.json": '{"ids": ["a"]}'},
                    "files that no rankwise command wrote"),
    "mine-report": ({"report.md": "# my notes\n", "notes.txt": "mine"}, "files that no rankwise command wrote"),
    "compress": ({"config.json": "{}", "model.safetensors": "x", "compression.safetensors": "x",
                  "report.json": "{}", "report.md": "# compress\n"}, "a compress output"),
    "select": ({"scores.jsonl": "", "chosen.json": "{}", "rankwise.json": '{"kind": "select"}'},
               "a data selection"),
    "inspect": ({"inspect.json": "{}", "report.md": "# rankwise inspect\n"}, "an inspect report"),
    "merge": ({"adapter_config.json": "{}", "merge.json": "{}"}, "a merged adapter"),
    "distill": ({"distill.yaml": "steps: 4\n", "events.jsonl": ""}, "a distill run"),
    "vfl": ({"config.yaml": "vfl: {mode: sync}\n", "metrics.json": "{}", "results.md": "|"}, "a vfl run"),
}


@pytest.fixture
def foreign(tmp_path, tiny_bert_run):
    """``{name: (folder, phrase its refusal names)}``: a copy of a train run and :data:`FOREIGN`."""
    out = {"train": (tmp_path / "train", "a train run")}
    shutil.copytree(tiny_bert_run, tmp_path / "train")
    for name, (files, phrase) in FOREIGN.items():
        out[name] = (_write(tmp_path / name, files), phrase)
    return out


def _commands(tmp_path: Path, tiny_bert_run: Path) -> dict[str, tuple]:
    """``{command: (argv before --out, its own kind)}``; each is refused before any work."""
    select_cfg = tmp_path / "select.yaml"
    raw = yaml.safe_load((tiny_bert_run / "config.yaml").read_text())
    raw["data"]["select"] = {"name": "random", "budget": 0.5}
    select_cfg.write_text(yaml.safe_dump(raw))
    vfl_cfg = tmp_path / "vfl.yaml"
    vfl_cfg.write_text(yaml.safe_dump({"vfl": {"mode": "sync", "epochs": 1}}))
    return {"select": (("select", select_cfg), "select"),
            "inspect": (("inspect", tiny_bert_run), "inspect"),
            "merge": (("merge", tiny_bert_run, "--method", "linear", "--weights", "1"), "merge"),
            "distill": (("distill", tiny_bert_run, "--student-hidden", 8), "distill"),
            "vfl": (("vfl", vfl_cfg), "vfl")}


@pytest.mark.parametrize("command", ["select", "inspect", "merge", "distill", "vfl"])
def test_a_writing_command_refuses_every_folder_it_did_not_write(tmp_path, tiny_bert_run, foreign, command):
    argv, own = _commands(tmp_path, tiny_bert_run)[command]
    for name, (folder, phrase) in foreign.items():
        if name == own:
            continue
        before = tree(folder)
        line = one_line(invoke(*argv, "--out", folder), phrase, "choose another --out")
        assert folders.WHAT[own] in line, line  # names what it writes
        assert tree(folder) == before, (command, name)


def test_the_users_own_select_files_and_a_train_run_survive_select(tmp_path, tiny_bert_run, foreign):
    """The issue's two cases, spelled out: exit 2, one line, every byte kept, nothing added."""
    argv, _ = _commands(tmp_path, tiny_bert_run)["select"]
    for name in ("mine-select", "train"):
        folder = foreign[name][0]
        before = tree(folder)
        one_line(invoke(*argv, "--out", folder))
        assert tree(folder) == before  # every byte kept, no scores.png or rankwise.json added


def test_inspect_keeps_a_compress_report_and_another_run(tmp_path, tiny_bert_run, foreign):
    for name in ("compress", "mine-report", "train"):
        folder = foreign[name][0]
        before = tree(folder)
        one_line(invoke("inspect", tiny_bert_run, "--out", folder), "inspect writes only")
        assert tree(folder) == before
        assert not (folder / "inspect.json").exists() and not (folder / "spectra").exists()


def test_train_and_compare_refuse_the_new_kinds(tmp_path, tiny_bert_run, foreign):
    """A vfl run's config.yaml no longer passes for a train run, recorded or not."""
    for name in ("select", "inspect", "merge", "distill", "vfl"):
        folder, phrase = foreign[name]
        before = tree(folder)
        one_line(invoke("train", tiny_bert_run / "config.yaml", "--out", folder), phrase, "not a train run")
        one_line(invoke("compare", tiny_bert_run / "config.yaml", "--methods", "lora", "--seeds", "1",
                        "--out", folder), phrase)
        assert tree(folder) == before


@pytest.mark.parametrize("name,files,kind", [
    ("vfl", {"config.yaml": "vfl: {mode: sync}\n", "metrics.json": "{}", "results.md": "|"}, "vfl"),
    ("distill", {"distill.yaml": "steps: 4\n", "checkpoints/x": ""}, "distill"),
    ("inspect", {"inspect.json": "{}", "report.md": "#", "spectra.png": ""}, "inspect"),
    ("merge", {"adapter_config.json": "{}", "adapter_model.safetensors": "", "merge.json": "{}"}, "merge"),
    ("select", {"scores.jsonl": "", "scores.png": "",
                "chosen.json": '{"method": "random", "ids": [], "seconds": 0.1}'}, "select"),
    # the user's own files: not taken for a selection, so nothing writes over them
    ("mine", {"scores.jsonl": "", "chosen.json": '{"method": "random", "ids": [], "seconds": 0.1}'}, "other"),
    ("mine2", {"scores.jsonl": "", "scores.png": "", "chosen.json": '{"ids": []}'}, "other"),
])
def test_folders_written_before_the_record_are_recognised(tmp_path, name, files, kind):
    folder = tmp_path / name
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    assert folders.kind(folder) == kind


def test_a_recorded_merge_output_is_also_a_merge_input(tmp_path):
    """merge reads its own output as the PEFT folder it is (kind ``merge``, not ``peft``)."""
    from rankwise.commands.merge.run import _source
    folder = _write(tmp_path / "m", {"adapter_config.json": json.dumps({"base_model_name_or_path": "b"}),
                                     "merge.json": "{}", "rankwise.json": '{"kind": "merge"}'})
    src = _source(folder)
    assert (src.kind, src.base) == ("peft", "b")
