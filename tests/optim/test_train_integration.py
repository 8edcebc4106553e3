"""``rankwise train`` runs with every optimizer on the demo task (full fine-tuning of tiny-bert)."""
import json
import math

import pytest

from rankwise.recipes.config import load_run_config
from rankwise.recipes.train import train

OPTIMS = {"adamw": {}, "galore": {"rank": 4, "update_every": 2}, "galore-is": {"rank": 4, "update_every": 2},
          "sumo": {"rank": 4, "update_every": 2}, "q3r": {"rank": 4, "update_every": 2}, "ngn-m": {"lr": 0.5}}


@pytest.mark.parametrize("name", sorted(OPTIMS))
def test_train_runs_with_each_optimizer(tmp_path, name):
    raw = {
        "model": {"path": "tiny-bert", "task": "classification"},
        "data": {"source": "demo", "max_length": 24, "limit": 64},
        "method": {"name": "full"},
        "optim": {"name": name, **OPTIMS[name]},
        "train": {"steps": 4, "batch_size": 8, "save_every": 2, "log_every": 1, "eval_every": 4,
                  "progress": False},
    }
    metrics = train(load_run_config(None, base=raw), tmp_path / name)
    assert metrics["steps"] == 4 and math.isfinite(metrics["eval_loss"])
    events = [json.loads(x) for x in (tmp_path / name / "events.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in events if "loss" in e]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)


def test_cli_train_with_a_low_rank_optimizer_and_bad_rank(tmp_path):
    import yaml
    from click.testing import CliRunner

    from rankwise.cli import main
    raw = {"model": {"path": "tiny-bert", "task": "classification"},
           "data": {"source": "demo", "max_length": 24, "limit": 32},
           "method": {"name": "full"}, "optim": {"name": "galore-is", "rank": 4, "update_every": 2},
           "train": {"steps": 2, "batch_size": 8, "progress": False}}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    ok = CliRunner().invoke(main, ["train", str(cfg), "--out", str(tmp_path / "run")])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "run" / "metrics.json").is_file()
    raw["optim"]["rank"] = 0
    cfg.write_text(yaml.safe_dump(raw))
    bad = CliRunner().invoke(main, ["train", str(cfg), "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "optim.rank: got 0" in bad.output
