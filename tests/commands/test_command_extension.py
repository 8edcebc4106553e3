"""Adding a command touches only its own module plus one registration.

The command below (``rankwise test-tally CONFIG [--set ...] [--out DIR]``: the words of a text
file, counted) is written the way a module under ``rankwise/commands/`` would be - a config
dataclass with its own checks, a click command that reads it through the commands' one reader,
a folder kind, an example - and registered with one ``registry.register`` call. Nothing else in
rankwise is edited, yet ``rankwise --help`` and ``rankwise list`` show it, its config is read
as every config is (YAML 1.2 numbers, ``--set``, every problem in one line), it refuses another
command's folder and other commands refuse its folder, and it passes the command contract.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import click
from click.testing import CliRunner

from rankwise import registry
from rankwise.cli import main
from rankwise.commands.options import config_argument, default_out, out_option, read_config, set_option, write_config
from rankwise.recipes import folders
from tests.commands.test_command_contract import check_command, one_error

NAME = "test-tally"


@dataclass
class TallyConfig:
    """``text``: the file whose words are counted; ``top``: how many of the commonest to keep;
    ``weight``: a factor the counts are multiplied by."""

    text: str = ""
    top: int = 3
    weight: float = 1.0

    def problems(self) -> list[str]:
        return [] if self.top >= 1 else [f"top: got {self.top}; expected >= 1"]


@click.command(NAME)
@config_argument
@set_option
@out_option(NAME)
def tally(config: Path, sets: tuple[str, ...], out: Path | None) -> None:
    """Count the words of CONFIG's text file."""
    from collections import Counter

    from rankwise.core import atomic
    cfg = read_config(TallyConfig, config, sets, "tally", paths={("text",): ()})
    out = out or default_out(config, NAME)
    folders.check_writable(out, NAME, NAME)
    words = Counter(Path(cfg.text).read_text().split())
    out.mkdir(parents=True, exist_ok=True)
    folders.record(out, NAME)
    atomic.write_json(out / "tally.json", {w: n * cfg.weight for w, n in words.most_common(cfg.top)})
    click.echo(f"wrote {out}")


def example(folder: Path) -> list[str]:
    (Path(folder) / "text.txt").parent.mkdir(parents=True, exist_ok=True)
    (Path(folder) / "text.txt").write_text("a b a c a b\n")
    return [str(write_config(folder, {"text": "text.txt"})), "--out", str(Path(folder) / "out")]


registry.register("command", NAME, TallyConfig, tally, summary="test command: a word count", writes=NAME,
                  example=example)


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_the_cli_and_list_show_it():
    assert NAME in invoke("--help").output
    listed = [line.split()[1] for line in invoke("list").output.splitlines() if line.startswith("command ")]
    assert listed == registry.names("command") and NAME in listed


def test_it_passes_the_command_contract(tmp_path):
    check_command(NAME, tmp_path)


def test_it_reads_its_config_like_every_command(tmp_path):
    args = example(tmp_path)
    res = invoke(NAME, *args, "--set", "top=2", "--set", "weight=1e-3")
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out" / "tally.json").read_text()) == {"a": 3e-3, "b": 2e-3}
    assert folders.kind(tmp_path / "out") == NAME
    one_error(invoke(NAME, *args, "--set", "top=0", "--set", "wieght=2"),
              "tally.wieght: unknown key", "did you mean 'weight'", "tally.top: got 0; expected >= 1")


def test_other_commands_refuse_its_folder(tmp_path):
    example(tmp_path)
    assert invoke(NAME, tmp_path / "config.yaml", "--out", tmp_path / "out").exit_code == 0
    line = one_error(invoke("inspect", "tiny-llama", "--out", tmp_path / "out"), str(tmp_path / "out"))
    assert "test command: a word count (rankwise test-tally)" in line
