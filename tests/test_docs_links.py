"""User-facing text never sends a reader to the project's internal files (issue 33 item 8).

Users of rankwise get docs/, README.md, examples/ and the package; they do not get the
project's planning folder (its roadmap, reading notes and paper-abstract seeds). A sentence that
cites one of those must cite the paper (authors, title, venue / arXiv id) and the rankwise docs
page instead. README's Methods table keeps the catalogue ids (A4, B5, ...) as row labels; its
header says ``id``, not ``ROADMAP``, so no exception is needed: any ``ROADMAP`` fails, and a doc
that wants an id says "README row B5". Reads files only: no processes, no imports of rankwise.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = [ROOT / "README.md", ROOT / "docs", ROOT / "examples", ROOT / "src" / "rankwise"]
SUFFIXES = {".md", ".py", ".yaml", ".yml", ".txt", ".json", ".toml", ".cfg", ".rst"}
FORBIDDEN = re.compile(
    r"ROADMAP"  # the internal method catalogue
    r"|shared/notes|shared/seeds|shared/reviews|/work/shared"  # the internal folders
    r"|\bnotes §"  # "notes §4.2": a section of the internal reading notes
    r"|\bseeds? 0\d\d\b"  # "seed 004": an internal abstract collection
)


def _files():
    for base in SCANNED:
        paths = [base] if base.is_file() else sorted(base.rglob("*"))
        for path in paths:
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                yield path


def test_no_user_facing_text_cites_internal_files():
    hits = []
    for path in _files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not hits, "cite the paper and the docs page instead of internal files:\n" + "\n".join(hits)


def test_pattern_catches_each_internal_reference():
    for text in ("(ROADMAP B7)", "`shared/notes/compression.md` §4", "`/work/shared/seeds/004`",
                 "notes §4.1", "abstract: seed 004", "shared/seeds/000_*"):
        assert FORBIDDEN.search(text), text
    for text in ("README row B7", "seed 0 and seed 1", "--seed 3", "bench/results/x-seeds/",
                 "shared memory meter", "the mean over 3 seeds"):
        assert not FORBIDDEN.search(text), text


def test_scan_sees_the_user_facing_tree():
    names = {p.relative_to(ROOT).as_posix() for p in _files()}
    assert "README.md" in names
    assert "docs/optimizers.md" in names
    assert "src/rankwise/obfuscation.py" in names
    assert any(n.startswith("examples/") for n in names)
