"""The command contract: every registered command (kind ``command``) answers ``--help``; one that
reads a ``CONFIG`` refuses a bad key in one line with exit 2 and no traceback; one that writes a
folder refuses an ``--out`` of another kind (another command's output, or the user's own files)
the same way, before it reads anything else, leaving every file there as it was.

In process (click's ``CliRunner``): no subprocess, no model, so it stays in ``make test-fast``.
A command defined outside the package passes the same checks with nothing else edited
(``tests/commands/test_command_extension.py`` calls :func:`check_command`).
"""
from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from rankwise import registry
from rankwise.cli import main
from rankwise.recipes import folders, yamlfile
from rankwise.testing import error_lines

NEEDS = {"federated": "flwr", "vfl": "flwr"}  # a command's optional dependency
BAD_KEY = "no_such_key"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error(res, *needles) -> str:
    """The one ``error:`` line of a refused command (exit 2, no traceback), holding ``needles``."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def tree(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder``."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def check_help(name: str) -> None:
    """``rankwise NAME --help`` exits 0 with a usage line naming the command (``bench`` hands
    it to the checkout's benchmarks, whose usage line is their own)."""
    res = invoke(name, "--help")
    assert res.exit_code == 0, res.output
    assert re.search(rf"^usage: \S+ {re.escape(name)}\b", res.output, re.I | re.M), res.output


def check_bad_key(name: str, folder: Path) -> str:
    """The command's example with an unknown top-level key in its config: one line naming it."""
    args = registry.get("command", name).example(folder)
    config = folder / "config.yaml"
    assert str(config) in args, f"command {name!r} reads a config: its example must pass {config}"
    raw = yamlfile.load(config.read_text())
    config.write_text(yamlfile.dump({**raw, BAD_KEY: 1}, sort_keys=False))
    return one_error(invoke(name, *args), BAD_KEY)


def check_wrong_folder(name: str, folder: Path, planted: str) -> str:
    """The command's example with ``folder/out`` holding ``planted`` (a folder kind, or
    ``"other"``: files of the user's own): one line naming the folder, every file unchanged."""
    entry = registry.get("command", name)
    args = entry.example(folder)
    out = folder / "out"
    assert str(out) in args, f"command {name!r} writes a folder: its example must write {out}"
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("the user's own file\n")
    if planted != "other":
        folders.record(out, planted)
    before = tree(folder)
    line = one_error(invoke(name, *args), str(out))
    assert tree(folder) == before
    return line


def planted_kinds(writes: str) -> list[str]:
    """Another command's kind and the user's own files (``other``)."""
    return ["inspect" if writes != "inspect" else "select", "other"]


def check_command(name: str, folder: Path) -> None:
    """Every check of the contract that applies to command ``name``."""
    entry = registry.get("command", name)
    assert entry.builder.name == name and entry.summary, name
    check_help(name)
    if entry.config_cls is not None:
        check_bad_key(name, folder / "bad-key")
    if entry.writes is not None:
        assert folders.what(entry.writes) is not None, (name, entry.writes)
        for planted in planted_kinds(entry.writes):
            check_wrong_folder(name, folder / f"wrong-{planted}", planted)


def _skip_without_needs(name: str) -> None:
    need = NEEDS.get(name)
    if need and importlib.util.find_spec(need) is None:
        pytest.skip(f"{name} needs {need}")


def test_every_subcommand_but_train_is_registered():
    assert set(registry.names("command")) >= {
        "export", "transfer", "merge", "generate", "demo", "compare", "federated", "select", "vfl",
        "compress", "obfuscate", "distill", "inspect", "continual", "bench", "plan", "list"}
    assert "train" not in registry.names("command")
    assert set(main.list_commands(None)) == {"train", *registry.names("command")}


@pytest.mark.parametrize("name", registry.names("command"))
def test_each_command_answers_help(name):
    check_help(name)


@pytest.mark.parametrize("name", [n for n in registry.names("command")
                                  if registry.get("command", n).config_cls is not None])
def test_each_config_command_refuses_a_bad_key_in_one_line(name, tmp_path):
    _skip_without_needs(name)
    check_bad_key(name, tmp_path)


@pytest.mark.parametrize("name", [n for n in registry.names("command") if registry.get("command", n).writes])
def test_each_writing_command_refuses_a_folder_of_another_kind(name, tmp_path):
    _skip_without_needs(name)
    for planted in planted_kinds(registry.get("command", name).writes):
        check_wrong_folder(name, tmp_path / planted, planted)


def test_the_checks_catch_a_command_that_breaks_them(tmp_path):
    """A command that writes into any folder and ignores its config's keys fails the contract."""
    import click

    @click.command("test-careless")
    @click.argument("config", type=click.Path(path_type=Path))
    @click.option("--out", type=click.Path(path_type=Path))
    def careless(config, out):
        out.mkdir(exist_ok=True)
        (out / "notes.txt").write_text("overwritten")

    def example(folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.yaml").write_text("steps: 1\n")
        return [str(folder / "config.yaml"), "--out", str(folder / "out")]
    registry.register("command", "test-careless", dict, careless, summary="breaks the contract",
                      writes="train", example=example)
    try:
        with pytest.raises(AssertionError):
            check_bad_key("test-careless", tmp_path / "a")
        with pytest.raises(AssertionError):
            check_wrong_folder("test-careless", tmp_path / "b", "other")
    finally:
        registry._ENTRIES.pop(("command", "test-careless"))
