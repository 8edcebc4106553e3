"""``rankwise bench continual``'s report from pieces: means over orders and forgetting."""
import json

import pytest

from rankwise_bench.continual import report
from rankwise.commands.continual.run import summary


def _piece(path, rules, order):
    rec = {"config": {"steps_per_task": 1, "batch_size": 2, "eval_per_class": 1}, "order": order,
           "rules": {r: {"matrix": m, **summary(m)} for r, m in rules.items()},
           "rematch": {m: {"switched": [0, 1], "unsure": [0, 2], "unsure_tuned": [0, 1], "tau_tuned": [-10.0, -2.5],
                           "score_min": [-1.0, -3.0], "score_max": [0.0, -0.5], "match_task_accuracy": [1.0, 0.5]}
                       for m in ("tii", "keys")}}
    path.write_text(json.dumps(rec))


def test_report_averages_orders_and_reads_only_present_pieces(tmp_path):
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    per_task = lambda a, b: {r: m for r, m in {"keys:match": a, "tii:match": a, "keys:hrm-tuned": b,
                                               "tii:hrm-tuned": b, "oracle": b}.items()}
    _piece(pieces / "key-match-0.json", per_task([[1.0], [0.5, 0.9]], [[1.0], [0.8, 0.9]]), [0, 1])
    _piece(pieces / "key-match-1.json", per_task([[0.8], [0.6, 0.7]], [[0.8], [0.8, 0.6]]), [1, 0])
    result = report(tmp_path)
    row = result["rows"]["key-match [keys:match]"]
    assert row["acc_mean"] == pytest.approx(((0.5 + 0.9) / 2 + (0.6 + 0.7) / 2) / 2)
    assert row["forget_mean"] == pytest.approx(((1.0 - 0.5) + (0.8 - 0.6)) / 2)
    assert row["curve"] == pytest.approx([0.9, 0.675])
    assert result["rows"]["key-match [tii:hrm-tuned]"]["acc_mean"] == pytest.approx((0.85 + 0.7) / 2)
    assert "hrm-pet [tii:hrm]" not in result["rows"] and result["pieces"] == ["key-match-0", "key-match-1"]
    md = (tmp_path / "results.md").read_text()
    assert "| key-match [keys:match] | 2 | 67.5 ± 3.5 | 35.0 |" in md
    assert "- key-match [tii]: switched [0, 1], unsure [0, 2], unsure at tuned tau [0, 1] (tau [-10.0, -2.5])" in md and (tmp_path / "accuracy.png").exists()
