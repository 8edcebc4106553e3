"""Fixtures of the task tests (the helpers they share are ``pair_fixtures.py``'s)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tasks.pair_fixtures import pair_records


@pytest.fixture(scope="module")
def pairs_jsonl(tmp_path_factory) -> Path:
    """A JSONL file of :func:`~tests.tasks.pair_fixtures.pair_records` (24 real-text pairs)."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in pair_records()))
    return path
