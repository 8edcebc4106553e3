"""Every config under ``examples/`` is valid as shipped: a plain run config builds, and each row
of a comparison's ``compare:`` section builds with its overrides."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from rankwise.commands.compare.run import row_config
from rankwise.recipes.config import build_run_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 8


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_builds(path):
    raw = yaml.safe_load(path.read_text())
    rows = raw.pop("compare", None) or {}
    cfg = build_run_config(copy.deepcopy(raw))
    assert cfg.train.steps >= 1
    for row, extra in rows.items():
        extra = {k: v for k, v in (extra or {}).items() if k != "lr_grid"}
        build_run_config(row_config(raw, row, extra))
