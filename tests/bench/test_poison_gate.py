"""The LoPE poisoning-gate summary (``rankwise_bench.poison_gate``) on a comparison folder built
by hand: its numbers are the mean, range and noisy-above-task share over the layers, and the
cross-level table is LoPE minus LoRA from each ``results.json``."""
from __future__ import annotations

import json

import pytest

from rankwise_bench import poison_gate


def _gate(noisy, task, ev):
    return {"noisy": {"mean": noisy, "tokens": 10}, "task": {"mean": task, "tokens": 10},
            "eval": {"mean": ev, "tokens": 5}}


def _comparison(tmp_path):
    folder = tmp_path / "lope-noisy-40"
    layers = {"l0": {"default": {"experts": 3, "poison_gate": _gate(0.5, 0.2, 0.1)}},
              "l1": {"default": {"experts": 3, "poison_gate": _gate(0.3, 0.4, 0.3)}},
              "l2": {"default": {"experts": 3, "poison_gate": {"noisy": {"mean": 0.9, "tokens": 0}}}},
              "head": {"default": {"experts": 2}}}          # no poisoning expert: left out
    for run, acc in (("lr0.001", 0.5), ("seed0", 0.75)):
        (folder / "lope" / run).mkdir(parents=True)
        (folder / "lope" / run / "router_stats.json").write_text(json.dumps({"layers": layers}))
        (folder / "lope" / run / "metrics.json").write_text(json.dumps({"eval_accuracy": acc}))
    rows = {"lora": {"lr": 0.003, "mean": {"eval_accuracy": 0.80}, "std": {"eval_accuracy": 0.01}},
            "lope": {"lr": 0.001, "mean": {"eval_accuracy": 0.725}, "std": {"eval_accuracy": 0.05}}}
    (folder / "results.json").write_text(json.dumps({"sets": ["data.label_noise=0.4"], "rows": rows}))
    return folder


def test_the_gate_summary_is_the_mean_range_and_share_over_layers(tmp_path):
    folder = _comparison(tmp_path)
    runs = poison_gate.write_folder(folder)
    assert [r["run"] for r in runs] == ["lr0.001", "seed0"]          # sweep points, then seeds
    r = runs[1]
    assert r["layers"] == 2                                          # l2's noisy saw no token
    assert r["noisy"] == pytest.approx({"mean": 0.4, "min": 0.3, "max": 0.5})
    assert r["task"] == pytest.approx({"mean": 0.3, "min": 0.2, "max": 0.4})
    assert r["eval"] == pytest.approx({"mean": 0.2, "min": 0.1, "max": 0.3})
    assert r["noisy_above_task"] == 0.5 and r["eval_accuracy"] == 0.75
    assert json.loads((folder / "poison_gate.json").read_text()) == runs
    md = (folder / "poison_gate.md").read_text()
    assert "| seed0 | 75.0 | 0.400 (0.30-0.50) | 0.300 (0.20-0.40) | 0.200 (0.10-0.30) | 50% of 2 |" in md


def test_the_levels_table_is_lope_minus_lora(tmp_path):
    table = poison_gate.levels_markdown([_comparison(tmp_path)])
    assert "| 0.4 | 0.003 | 80.0 ± 1.0 | 0.001 | 72.5 ± 5.0 | -7.5 |" in table
