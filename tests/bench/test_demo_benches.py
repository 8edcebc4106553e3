"""The demo-task comparisons of issue 13 end to end at a toy size (tiny BERT, 2 steps, 1 seed):
files written, LoTA-QAF's merged codes on the grid, every row's numbers present."""
import json

import pytest

from rankwise_bench.common import Settings
from rankwise_bench import lota_qaf, nanoadam_ft

TOY = Settings(seeds=1, steps=2, model="tiny-bert", limit=64)


@pytest.mark.slow
def test_lota_qaf_bench(tmp_path):
    result = lota_qaf.run(tmp_path, TOY)
    assert set(result["runs"]) == set(lota_qaf.DEFAULT_ROWS)
    lota = result["runs"]["lota-qaf"][0]
    assert lota["codes_on_grid"] and 0 <= lota["merged_int_accuracy"] <= 1
    assert lota["state_bytes"] < result["runs"]["lora-rtn4"][0]["state_bytes"]   # only the head's
    assert "merged, re-quantized" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_nanoadam_bench(tmp_path):
    assert nanoadam_ft.main(["--out", str(tmp_path), "--seeds", "1", "--steps", "2", "--model", "tiny-bert",
                             "--limit", "64"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    runs = {row: recs[0] for row, recs in result["runs"].items()}
    assert set(runs) == {"nanoadam", "adamw-full", "lora"}
    assert runs["nanoadam"]["state_bytes"] < 0.5 * runs["adamw-full"]["state_bytes"]
    assert all(-1 <= r["forgetting"] <= 1 for r in runs.values())
    assert (tmp_path / "task-b.jsonl").stat().st_size > 0


def test_unknown_row_is_one_line(tmp_path, capsys):
    assert lota_qaf.main(["--out", str(tmp_path), "--rows", "lorax"]) == 2
    assert "lota-qaf rows: got ['lorax']" in capsys.readouterr().err
