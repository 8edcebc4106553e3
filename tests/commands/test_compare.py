"""``rankwise compare``: row table, same budget, mean ± std over seeds, files written."""
from __future__ import annotations

import json
import statistics

import pytest
import yaml

from rankwise.errors import RankwiseError
from rankwise.optim.altlora import AltLoraConfig
from rankwise.commands.compare.run import markdown, parse_row, row_config, run_compare

BASE = {
    "model": {"path": "tiny-bert", "task": "classification"},
    "method": {"name": "lora", "r": 4, "alpha": 8, "targets": ["query", "value"]},
    "optim": {"name": "adamw", "lr": 0.005},
    "train": {"steps": 2, "batch_size": 8, "eval_batch_size": 64, "save_every": 0, "log_every": 1,
              "progress": False, "calibration_batches": 2},
}
WORDS = {"cat": "feline whiskers purr", "dog": "canine bark fetch", "fish": "fins swim gills"}


@pytest.fixture
def config(tmp_path):
    rows = [{"text": f"{WORDS[lab]} {i}", "label": lab} for i in range(12) for lab in WORDS]
    data = tmp_path / "pets.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {**BASE, "data": {"source": str(data), "max_length": 8, "eval_fraction": 0.25},
           "compare": {"gora": {"method": {"n_batches": 2, "r_min": 1}}}}
    path = tmp_path / "cmp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_rows_share_the_budget_and_keep_the_head_optimizer():
    gora = row_config(BASE, "gora")
    assert gora["method"] == {"name": "gora", "r": 4, "alpha": 8, "targets": ["query", "value"]}
    alt = row_config(BASE, "altlora")
    assert alt["method"] == BASE["method"]
    assert alt["optim"]["name"] == "altlora" and alt["optim"]["head_lr"] == 0.005
    assert "lr" not in alt["optim"]                                  # AltLoRA's own default
    assert parse_row("gora+altlora") == ("gora", "altlora") and parse_row("altlora") == ("lora", "altlora")
    assert row_config(BASE, "full+galore")["optim"] == {"name": "galore"}
    assert row_config(BASE, "full")["optim"] == BASE["optim"] and row_config(BASE, "full")["method"] == {"name": "full"}
    assert AltLoraConfig().lr == 1.0
    assert row_config(BASE, "lora", {"optim": {"lr": 0.1}})["optim"] == {"name": "adamw", "lr": 0.1}
    with pytest.raises(RankwiseError, match="did you mean 'gora'"):
        row_config(BASE, "goraa")


def test_named_variant_rows_run_their_method_with_their_overrides():
    """``compare: {rslora: {row: lora, method: {use_rslora: true}}}``: a row of its own name, the
    LoRA row's budget (the shared method keys) and the entry's overrides; an unknown ``row:``
    target is refused naming the entry."""
    from rankwise.commands.compare.run import plan_rows
    raw = {**BASE, "compare": {"rslora": {"row": "lora", "method": {"use_rslora": True}},
                               "fast-gora": {"row": "gora+altlora", "lr_grid": [0.1, 1.0]}}}
    plans, grids, _ = plan_rows(json.loads(json.dumps(raw)), ["lora", "rslora", "fast-gora"], [])
    assert plans["rslora"]["method"] == {**BASE["method"], "use_rslora": True}
    assert plans["lora"]["method"] == BASE["method"]
    assert plans["fast-gora"]["method"]["name"] == "gora" and plans["fast-gora"]["optim"]["name"] == "altlora"
    assert grids == {"lora": None, "rslora": None, "fast-gora": [0.1, 1.0]}
    assert "row" not in plans["rslora"] and "compare" not in plans["rslora"]
    bad = {**BASE, "compare": {"x": {"row": "lorra"}}}
    with pytest.raises(RankwiseError, match=r"compare.x: unknown comparison row 'lorra'.*did you mean 'lora'"):
        plan_rows(bad, ["x"], [])


@pytest.mark.slow
def test_two_methods_two_seeds_table(config, tmp_path):
    out = tmp_path / "cmp"
    result = run_compare(config, ["lora", "gora"], 2, ["train.steps=2"], out)
    rows = result["rows"]
    assert list(rows) == ["lora", "gora"]
    for row in rows:
        per_seed = [json.loads((out / row / f"seed{k}" / "metrics.json").read_text()) for k in (0, 1)]
        assert rows[row]["runs"] == per_seed and rows[row]["seeds"] == 2
        accs = [m["eval_accuracy"] for m in per_seed]
        assert rows[row]["mean"]["eval_accuracy"] == pytest.approx(statistics.fmean(accs))
        assert rows[row]["std"]["eval_accuracy"] == pytest.approx(statistics.stdev(accs))
        losses = [m["eval_loss"] for m in per_seed]
        assert rows[row]["mean"]["eval_loss"] == pytest.approx(statistics.fmean(losses))
        assert rows[row]["std"]["eval_loss"] == pytest.approx(statistics.stdev(losses))
        for k in (0, 1):
            assert yaml.safe_load((out / row / f"seed{k}" / "config.yaml").read_text())["train"]["seed"] == k
    assert rows["gora"]["overrides"]["method"]["n_batches"] == 2      # the compare: section
    assert (out / "gora/seed0/ranks.json").is_file()
    # the same parameter budget: GoRA is within one layer's (m + n) = 64 of LoRA
    lora_p, gora_p = rows["lora"]["mean"]["trainable_params"], rows["gora"]["mean"]["trainable_params"]
    assert abs(lora_p - gora_p) < 64
    assert json.loads((out / "results.json").read_text())["rows"]["lora"]["mean"] == rows["lora"]["mean"]
    md = (out / "results.md").read_text()
    s = rows["lora"]
    acc = f"{100 * s['mean']['eval_accuracy']:.1f} ± {100 * s['std']['eval_accuracy']:.1f}"
    assert f"| lora | lora | adamw | 0.005 | {acc} | {s['mean']['eval_loss']:.4f} ± {s['std']['eval_loss']:.4f} |" in md
    assert (out / "results.png").stat().st_size > 1000
    again = run_compare(config, ["lora"], 2, ["train.steps=2"], out)   # finished runs are reused
    assert again["rows"]["lora"]["runs"] == rows["lora"]["runs"]


def test_bad_requests_fail_before_training(config, tmp_path):
    with pytest.raises(RankwiseError, match="unknown comparison row 'lorra'"):
        run_compare(config, ["lorra"], 1, [], tmp_path / "x")
    with pytest.raises(RankwiseError, match="seeds"):
        run_compare(config, ["lora"], 0, [], tmp_path / "x")
    with pytest.raises(RankwiseError, match="row 'gora'"):
        run_compare(config, ["lora", "gora"], 1, ["gora:method.r_max=0"], tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_markdown_perplexity_rows():
    summary = {"lora": {"method": "lora", "optim": "adamw", "seeds": 1, "runs": [],
                        "mean": {"eval_perplexity": 12.5, "eval_loss": 2.5, "trainable_params": 10},
                        "std": {"eval_perplexity": 0.0, "eval_loss": 0.0, "trainable_params": 0}}}
    assert "| lora | lora | adamw | - | 12.500 ± 0.000 | 2.5000 ± 0.0000 | 10 |" in markdown(summary, "t")


def test_markdown_exact_match_columns_appear_when_the_runs_measured_them():
    """A causal-LM table gains exact match and token accuracy (percent) when its runs have them;
    an older table without them renders as before (its committed results.md regenerates)."""
    summary = {"lora": {"method": "lora", "optim": "adamw", "seeds": 2, "runs": [],
                        "mean": {"eval_perplexity": 12.5, "eval_loss": 2.5, "trainable_params": 10,
                                 "eval_exact_match": 0.25, "eval_token_accuracy": 0.625},
                        "std": {"eval_perplexity": 0.0, "eval_loss": 0.0, "trainable_params": 0,
                                "eval_exact_match": 0.05, "eval_token_accuracy": 0.0125}}}
    table = markdown(summary, "t")
    assert "| eval perplexity | exact match (%) | token accuracy (%) | eval loss |" in table
    assert "| 12.500 ± 0.000 | 25.0 ± 5.0 | 62.5 ± 1.2 | 2.5000 ± 0.0000 | 10 |" in table


@pytest.mark.slow
def test_lr_sweep_chooses_on_validation_and_trains_seeds_at_the_best(config, tmp_path, monkeypatch):
    from rankwise.recipes import runs, sweep

    seen = []
    real = runs.run_one

    def spy(raw, run_dir, console, quiet=False):
        seen.append((raw["data"].get("holdout", "eval"), raw["optim"]["lr"], raw["train"]["seed"], run_dir.name))
        return real(raw, run_dir, console, quiet)

    monkeypatch.setattr(runs, "run_one", spy)
    cfg = yaml.safe_load(config.read_text())
    cfg["compare"]["lora"] = {"lr_grid": [0.001, 0.01, 0.1]}
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "sw"
    res = run_compare(config, ["lora"], 2, ["train.steps=2"], out, lr_grid=3)
    row = res["rows"]["lora"]
    sweeps = [s for s in seen if s[0] == "validation"]
    assert [s[1] for s in sweeps] == [0.001, 0.01, 0.1] and {s[2] for s in sweeps} == {0}
    finals = [s for s in seen if s[0] == "eval"]
    assert [s[2] for s in finals] == [0, 1] and {s[1] for s in finals} == {row["lr"]}
    by_lr = {p["lr"]: p for p in row["sweep"]}
    assert row["lr"] == sweep.best_point({lr: p for lr, p in by_lr.items()})
    assert "lr *" in (out / "results.md").read_text()
    # the validation rows come from the training split: sweep runs evaluated other examples
    val = json.loads((out / "lora" / "lr0.01" / "metrics.json").read_text())
    ev = json.loads((out / "lora" / "seed0" / "metrics.json").read_text())
    assert val["eval_loss"] != ev["eval_loss"]
    with pytest.raises(RankwiseError, match="expected 3 positive"):
        cfg["compare"]["lora"] = {"lr_grid": [0.001, 0.01]}
        config.write_text(yaml.safe_dump(cfg))
        run_compare(config, ["lora"], 1, [], tmp_path / "bad", lr_grid=3)


def test_validation_split_is_carved_from_training_data(tmp_path):
    import numpy as np

    from rankwise.data.text import validation_split
    rows = np.arange(1000)
    train, val = validation_split(rows, 0.1)
    assert 70 < len(val) < 130 and len(train) + len(val) == 1000
    assert not set(train) & set(val)
    again = validation_split(rows, 0.1)
    assert (again[1] == val).all()


@pytest.mark.parametrize("name", ["compare-tuned", "compare-reference"])
def test_every_row_of_a_shipped_comparison_resolves(name):
    """The rows named in the example's own command line build valid run configs (nothing trains);
    a typo in a row's settings would otherwise surface hours into a long comparison."""
    import re
    from pathlib import Path

    from rankwise.commands.compare.run import plan_rows
    from rankwise.recipes.config import read_yaml
    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.yaml"
    rows = re.search(r"--methods (\S+)", path.read_text()).group(1).split(",")
    plans, grids, _ = plan_rows(read_yaml(path), rows, [])
    assert set(plans) == set(rows) and len(rows) >= 22
    assert all(len(grids[row] or [1, 2, 3]) == 3 for row in rows)
