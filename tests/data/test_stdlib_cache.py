"""The built-in sources' disk cache: the records read back are the parsed ones, any input that
changes names another entry, and an unwritable folder only means parsing again."""
from __future__ import annotations

import json
import os

from rankwise.data import stdlib_cache
from rankwise.data.demo import load_demo_records
from rankwise.data.instruct import load_function_records
from rankwise.data.stdlib_cache import cached, source_key


def test_records_read_back_equal_the_parsed_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for loader in (load_function_records, load_demo_records):
        loader.cache_clear()
        parsed = loader(("json",)) if loader is load_function_records else loader(("email", "json"))
        loader.cache_clear()
        again = loader(("json",)) if loader is load_function_records else loader(("email", "json"))
        loader.cache_clear()
        assert again == parsed and type(again) is type(parsed) and len(parsed) > 0
    names = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "rankwise").iterdir())
    assert names == ["demo", "stdlib"]  # one entry each, no temporary file left


def test_the_second_read_does_not_parse(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def build():
        calls.append(1)
        return [{"id": "a:f:1", "label": 3, "text": "x"}]
    assert cached("k", "demo", build) == cached("k", "demo", build) == build()
    assert len(calls) == 2  # the first cached() and the explicit build(): the second read the file


def test_each_input_names_another_entry(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    src, loader = root / "pkg" / "m.py", tmp_path / "loader.py"
    src.write_text("def f():\n    '''one two three'''\n")
    loader.write_text("# v1\n")
    key = source_key("demo", ("pkg",), root, [src], str(loader))
    assert key == source_key("demo", ("pkg",), root, [src], str(loader))
    assert key != source_key("stdlib-functions", ("pkg",), root, [src], str(loader))
    assert key != source_key("demo", ("pkg", "other"), root, [src], str(loader))
    os.utime(src, ns=(1, 1))
    touched = source_key("demo", ("pkg",), root, [src], str(loader))
    assert touched != key
    loader.write_text("# v2\n")
    assert source_key("demo", ("pkg",), root, [src], str(loader)) != touched


def test_an_unwritable_or_corrupt_cache_parses_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    (tmp_path / "file").write_text("not a folder")  # the cache folder cannot be made
    assert cached("k", "demo", lambda: [1, 2]) == [1, 2]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ok"))
    folder = stdlib_cache.cache_folder()
    folder.mkdir(parents=True)
    (folder / "demo-k.json").write_text("{truncated")
    assert cached("k", "demo", lambda: [3]) == [3]
    assert json.loads((folder / "demo-k.json").read_text()) == [3]
