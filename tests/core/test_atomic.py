"""Atomic writes follow the user's umask (like transformers' own files), not mkstemp's 0600."""
import os

from rankwise.core import atomic


def test_files_and_folders_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic.write_json(tmp_path / "m.json", {"a": 1})
        with atomic.folder(tmp_path / "out") as tmp:
            atomic.write_bytes(tmp / "w.bin", b"x")
            (tmp / "sub").mkdir()
        os.umask(0o077)
        atomic.write_json(tmp_path / "private.json", {})
    finally:
        os.umask(old)
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    assert mode(tmp_path / "m.json") == 0o644
    assert mode(tmp_path / "out") == 0o755 and mode(tmp_path / "out" / "w.bin") == 0o644
    assert mode(tmp_path / "out" / "sub") == 0o755
    assert mode(tmp_path / "private.json") == 0o600
