"""``rankwise distill CONFIG``: the spelling of every config command (``teacher:`` in the file,
``--set``, a default ``--out``), and the old ``distill TEACHER --out DIR [--config FILE]`` read
with a one-line notice. No model is trained here (``tests/compress/test_clone.py`` does)."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.commands.distill.run import read_command
from rankwise.errors import RankwiseError
from rankwise.testing import error_lines


def test_config_holds_the_teacher_and_set_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "teacher").mkdir()
    (tmp_path / "cfgs" / "d.yaml").write_text("teacher: teacher\nstudent_hidden: 16\nlr: 1e-3\n")
    teacher, cfg, out = read_command(Path("cfgs/d.yaml"), None, ["steps=5"], None, None)
    assert teacher == (tmp_path / "cfgs" / "teacher").resolve()              # from the config's folder
    assert (cfg.student_hidden, cfg.steps, cfg.lr) == (16, 5, 1e-3)
    assert out == Path("runs/d-distill")                                     # the default out rule
    assert read_command(Path("cfgs/d.yaml"), None, ["teacher=/elsewhere"], 8, Path("o"))[0::2] == (
        Path("/elsewhere"), Path("o"))


def test_the_old_spelling_still_reads_with_a_notice(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("steps: 3\n")
    teacher, cfg, out = read_command(tmp_path / "teacher", tmp_path / "c.yaml", [], 12, tmp_path / "o")
    assert (teacher, cfg.steps, cfg.student_hidden, out) == (tmp_path / "teacher", 3, 12, tmp_path / "o")
    err = capsys.readouterr().err
    assert err.count("\n") <= 1 and ("notice: distill TEACHER" in err or err == "")  # once per process
    with pytest.raises(RankwiseError, match="give --out DIR"):
        read_command(tmp_path / "teacher", None, [], 12, None)


@pytest.mark.parametrize("text, needles", [
    ("student_hidden: 8\n", ["teacher: missing"]),
    ("teacher: t\nstudent_hiden: 8\nsteps: many\n", ["distill.student_hiden: unknown key", "distill.steps: got 'many'"]),
])
def test_config_problems_are_one_line_exit_2(tmp_path, text, needles):
    (tmp_path / "d.yaml").write_text(text)
    res = CliRunner().invoke(main, ["distill", str(tmp_path / "d.yaml")])
    lines = error_lines(res.stderr)
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.output, res.output
    assert all(n in lines[0] for n in needles), lines[0]
    res = CliRunner().invoke(main, ["distill", str(tmp_path / "d.yaml"), "--config", str(tmp_path / "d.yaml")])
    assert res.exit_code == 2 and "drop --config" in res.stderr
