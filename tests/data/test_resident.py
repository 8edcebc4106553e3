"""Resident memory: columns are read as NumPy arrays (no Python object per record), the pages of
the memory-mapped files are released without changing what is read, and packing's array-based
stacks place examples exactly as a plain dict-of-lists best fit does."""
from __future__ import annotations

import bisect
import json
import sys

import numpy as np
import pytest

import rankwise.data.text as text
from rankwise.data.files import read_dataset, release_pages
from rankwise.data.instruct import load_function_records
from rankwise.data.packing import pack
from rankwise.data.text import build_data
from rankwise.engine import get_task
from rankwise.errors import RankwiseError
from rankwise.recipes.config import DataConfig
from rankwise.recipes.model import load_tokenizer

LM = get_task("causal-lm")
LINUX = sys.platform.startswith("linux")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resident")
    base = load_function_records()
    path = folder / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"[{i}] {base[i % len(base)]['prompt']}",
                                        "completion": base[i % len(base)]["completion"]}) + "\n"
                            for i in range(1200)))
    cfg = DataConfig(source=str(path), format="prompt-completion", max_length=64,
                     eval_fraction=0.05, cache_dir=str(folder / "c"))
    return path, build_data(cfg, LM, load_tokenizer("tiny-llama"))


def test_columns_are_numpy_arrays_equal_to_datasets_formatting(built):
    _, (train, _) = built
    got = text._column(train.ds, "_len")
    want = train.ds.select_columns(["_len"]).with_format("numpy")[:]["_len"]
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype and (got == want).all()
    assert (train.lengths() == [len(train[i]["input_ids"]) for i in range(len(train))]).all()


def test_released_pages_read_back_the_same(built):
    path, (train, evals) = built
    before = [train[i] for i in range(0, len(train), 7)] + [evals[i] for i in range(len(evals))]
    released = release_pages(train.ds, evals.ds, read_dataset(path))
    assert released > 0 if LINUX else released == 0
    after = [train[i] for i in range(0, len(train), 7)] + [evals[i] for i in range(len(evals))]
    assert after == before
    import datasets
    assert release_pages(datasets.Dataset.from_dict({"a": [1, 2]})) == 0  # in memory: untouched


def test_reading_examples_releases_pages_as_it_goes(built, monkeypatch):
    _, (train, _) = built
    calls = []
    monkeypatch.setattr(text, "release_pages", lambda *sets: calls.append(sets) or 0)
    train._read = 0
    for start in range(0, 3 * text.READ_RELEASE_EVERY, 16):
        train.rows(list(range(start, start + 16)))
    assert len(calls) == 3 and all(s == (train.ds,) for s in calls)


def test_empty_text_is_a_missing_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in
                            [{"prompt": "a", "completion": "b"}, {"prompt": "", "completion": "c"}] * 3))
    cfg = DataConfig(source=str(path), format="prompt-completion", cache_dir=str(tmp_path / "c"))
    with pytest.raises(RankwiseError, match=r"record 2 has (no|an empty) 'prompt' field"):
        build_data(cfg, LM, load_tokenizer("tiny-llama"))


def plain_best_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best fit decreasing with a dict of Python lists of open blocks (the reference)."""
    block = np.full(len(lengths), -1)
    caps: list[int] = []
    open_at: dict[int, list[int]] = {}
    n_blocks = 0
    for i in np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable").tolist():
        need = int(lengths[i])
        if need == 0:
            continue
        k = bisect.bisect_left(caps, need)
        if k == len(caps):
            b, left = n_blocks, capacity - need
            n_blocks += 1
        else:
            cap = caps[k]
            b = open_at[cap].pop()
            if not open_at[cap]:
                del open_at[cap], caps[k]
            left = cap - need
        block[i] = b
        if left > 0:
            if left not in open_at:
                open_at[left] = []
                bisect.insort(caps, left)
            open_at[left].append(b)
    kept = np.flatnonzero(block >= 0)
    order = kept[np.argsort(block[kept], kind="stable")]
    return order, np.concatenate([[0], np.cumsum(np.bincount(block[kept], minlength=n_blocks))])


@pytest.mark.parametrize("seed", range(6))
def test_pack_places_examples_as_plain_best_fit(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(1, 160))
    lengths = rng.integers(0, capacity + 1, size=int(rng.integers(0, 5000))).astype(np.int32)
    order, starts = pack(lengths, capacity)
    want_order, want_starts = plain_best_fit(lengths, capacity)
    assert (order == want_order).all() and (starts == want_starts).all()
