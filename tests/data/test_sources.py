"""Sources through HF ``datasets``: every file kind gives the same examples, tokenization is
cached, and broken files end with one line naming the problem."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankwise.data.files import read_dataset
from rankwise.data.instruct import load_function_records
from rankwise.data.text import build_data
from rankwise.engine import get_task
from rankwise.errors import RankwiseError
from rankwise.recipes.config import DataConfig
from rankwise.recipes.model import load_tokenizer

LM = get_task("causal-lm")


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return [{"prompt": r["prompt"], "completion": r["completion"]} for r in load_function_records()[:50]]


def write_all(folder: Path, records: list[dict]) -> dict[str, Path]:
    import datasets
    ds = datasets.Dataset.from_list(records)
    paths = {"jsonl": folder / "d.jsonl", "csv": folder / "d.csv", "parquet": folder / "d.parquet",
             "disk": folder / "saved"}
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in records))
    ds.to_csv(str(paths["csv"]), index=False)
    ds.to_parquet(str(paths["parquet"]))
    ds.save_to_disk(str(paths["disk"]))
    return paths


def examples(source: Path, cache: Path, **over) -> list[dict]:
    settings = {"format": "prompt-completion", "max_length": 128, **over}
    cfg = DataConfig(source=str(source), cache_dir=str(cache), **settings)
    train, evals = build_data(cfg, LM, load_tokenizer("tiny-llama"))
    return [train[i] for i in range(len(train))] + [evals[i] for i in range(len(evals))]


def test_every_source_kind_gives_the_same_examples(tmp_path, records):
    paths = write_all(tmp_path, records)
    got = {kind: examples(p, tmp_path / "cache") for kind, p in paths.items()}
    assert len(got["jsonl"]) == 50
    for kind in ("csv", "parquet", "disk"):
        assert got[kind] == got["jsonl"], kind


def test_tokenization_is_cached_and_keyed_on_the_settings(tmp_path, records):
    src = write_all(tmp_path, records)["jsonl"]
    cache = tmp_path / "cache"
    examples(src, cache)
    files = sorted(cache.rglob("cache-*.arrow"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    examples(src, cache)                          # same settings: the cached file is reused
    assert sorted(cache.rglob("cache-*.arrow")) == files and files[0].stat().st_mtime_ns == stamp
    examples(src, cache, max_length=96)           # other settings: a second file
    assert len(list(cache.rglob("cache-*.arrow"))) == 2


def test_records_stay_on_disk(tmp_path, records):
    train = build_data(DataConfig(source=str(write_all(tmp_path, records)["jsonl"]),
                                  format="prompt-completion", cache_dir=str(tmp_path / "c")),
                       LM, load_tokenizer("tiny-llama"))[0]
    assert all(Path(f["filename"]).is_file() for f in train.ds.cache_files)  # memory-mapped Arrow
    assert train.ds._indices is None and train.positions.dtype.kind == "i"    # rows: one int each
    assert train[3] == train.rows([3])[0] and train.subset([3, 1])[1] == train[1]


@pytest.mark.parametrize("name, content, match", [
    ("missing.jsonl", None, "not found"),
    ("empty.jsonl", "\n\n", "holds no records"),
    ("bad.jsonl", '{"prompt": "a", "completion": "b"}\n{"prompt": oops}\n', "line 2 is not valid JSON"),
    ("list.jsonl", '{"prompt": "a", "completion": "b"}\n[1, 2]\n', "line 2 is not a JSON object"),
    ("d.txt", "hello", "extension '.txt'"),
    ("bad.csv", 'prompt,completion\n"a,b\n', "not valid CSV"),
])
def test_broken_sources_end_in_one_line(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(RankwiseError, match=match) as err:
        read_dataset(path, str(tmp_path / "cache"))
    assert "\n" not in str(err.value)


def test_a_folder_with_splits_names_one(tmp_path, records):
    import datasets
    ds = datasets.Dataset.from_list(records)
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(RankwiseError, match=r"several splits \(train, test\).*dd/train"):
        read_dataset(tmp_path / "dd")
    with pytest.raises(RankwiseError, match="not a datasets save_to_disk folder"):
        read_dataset(tmp_path)
