"""``rankwise bench adapter-steps`` at toy size: every row is prepared as compare prepares it,
timed, and reported as a ratio to LoRA with the issue's 2x target judged."""
from __future__ import annotations

import json

import pytest
import yaml

from rankwise_bench.adapter_steps import CONFIG, run


@pytest.mark.slow
def test_rows_are_timed_against_lora(tmp_path):
    raw = yaml.safe_load(CONFIG.read_text())
    raw["model"]["path"] = "tiny-bert"                    # same rows, a model built in code
    raw["data"]["limit"] = 64
    cfg = tmp_path / "cmp.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    res = run(tmp_path / "out", steps=1, rows=("moe-lora", "smore"), config=cfg)
    rows = res["rows"]
    assert list(rows) == ["lora", "moe-lora", "smore"] and rows["lora"]["ratio"] == 1.0
    assert all(r["step_s"] > 0 and r["ratio"] == round(r["step_s"] / rows["lora"]["step_s"], 3)
               for r in rows.values())
    assert rows["moe-lora"]["trainable"] != rows["lora"]["trainable"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| smore |" in md and ("held (<= 2.0x)" in md or "did not hold (<= 2.0x)" in md)
    assert json.loads((tmp_path / "out" / "results.json").read_text())["threads"] == 1
