"""``rankwise train`` from the command line with a low-rank optimizer, and a bad rank reported
as one line with exit code 2. (Every optimizer's ``rankwise train`` run is in test_optimizer_contract.py.)"""
import pytest


@pytest.mark.slow
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
