"""The built-in pretraining corpus ``stdlib-source``: one record per standard-library module,
whole modules held out by the source's own rule, and the encoder honouring that rule."""
from __future__ import annotations

import zlib

from rankwise.data.corpus import heldout_module, load_source_records
from rankwise.data.formats import held_out
from rankwise.data.text import builtin_dataset


def test_records_are_whole_nonempty_modules_with_their_own_split():
    records = load_source_records()
    ids = [r["id"] for r in records]
    assert ids == sorted(ids) and len(set(ids)) == len(ids) > 300
    assert all(r["text"].strip() for r in records)
    assert not any(part in ("test", "tests", "idlelib") for r in records for part in r["id"].split("."))
    assert all(r["heldout"] == (zlib.crc32(r["id"].encode()) % 10 == 0) for r in records)
    held = sum(len(r["text"]) for r in records if r["heldout"])
    total = sum(len(r["text"]) for r in records)
    assert 0.03 < held / total < 0.25          # about a tenth of the text, whole modules
    assert heldout_module("json.decoder") == (zlib.crc32(b"json.decoder") % 10 == 0)


def test_the_sources_split_overrides_eval_fraction():
    ds = builtin_dataset("stdlib-source")
    assert set(ds.column_names) == {"text", "id", "heldout"}
    batch = ds[:50]
    flags = held_out(batch, list(range(50)), eval_fraction=0.9, use_id=True, key_field="text")
    assert flags == batch["heldout"]           # 0.9 would hold out most records; the column decides
