"""Every committed ``bench/results/**/results.md`` is what its benchmark's ``markdown(result)``
writes for the record beside it, byte for byte (``python -m rankwise_bench.regenerate``): the
Markdown is a rendering of the record, nothing typed in by hand, and moving or refactoring a
benchmark cannot change it unnoticed."""
from __future__ import annotations

from rankwise_bench import BENCHMARKS, regenerate


def test_every_committed_results_md_regenerates_from_its_record():
    folders = regenerate.committed()
    assert len(folders) >= 40   # the parse found the committed results (44 folders today)
    assert regenerate.differing() == []


def test_every_results_folder_names_a_benchmark_that_exists():
    assert set(regenerate.FOLDERS.values()) <= set(BENCHMARKS)
    named = set(regenerate.FOLDERS) | set(regenerate.NOT_GENERATED)
    assert {f.relative_to(regenerate.RESULTS).as_posix() for f in regenerate.committed()} == named


def test_a_changed_results_md_is_reported(tmp_path, monkeypatch):
    import shutil
    src = regenerate.RESULTS / "tpa"
    root = tmp_path / "results"
    shutil.copytree(src, root / "tpa")
    md = root / "tpa" / "results.md"
    md.write_text(md.read_text().replace("| mha |", "| MHA |"))
    monkeypatch.setattr(regenerate, "RESULTS", root)
    monkeypatch.setattr(regenerate, "FOLDERS", {"tpa": "tpa"})
    monkeypatch.setattr(regenerate, "NOT_GENERATED", {})
    assert regenerate.differing() == ["tpa"]
    assert regenerate.main(["--write"]) == 0 and regenerate.differing() == []
    assert md.read_text() == (src / "results.md").read_text()


def test_every_command_a_results_md_names_is_a_benchmark_of_the_table():
    """The command a ``results.md`` names runs from a checkout: ``rankwise bench NAME`` with a
    known NAME, and options beyond ``--out`` only where the benchmark takes them."""
    import re
    import shlex

    from rankwise_bench import _split_out
    lines = [line for f in regenerate.RESULTS.rglob("results.md")
             for line in f.read_text().replace("\\\n", " ").splitlines() if not line.startswith("#")]
    commands = [m.group(1) for line in lines for m in re.finditer(r"rankwise bench ([^`]+)", line)]
    assert len(commands) >= 15
    for command in commands:
        name, *args = shlex.split(command.replace("$seed", "0"))
        assert name in BENCHMARKS, command
        _, options = _split_out(args)
        assert not options or BENCHMARKS[name].cli is not None, command
