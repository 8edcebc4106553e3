"""A missing optional dependency ends with one line naming the pip extra (exit 2)."""
import importlib.util

import pytest
from click.testing import CliRunner

from rankwise.cli import main


@pytest.mark.parametrize("args,module,extra", [
    (["federated", "cfg.yaml"], "flwr", "federated"),
    (["bench", "lora-vs-peft", "--out", "x"], "peft", "bench"),
])
def test_missing_extra_names_the_install_command(monkeypatch, tmp_path, args, module, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == module else real(name, *a, **k))
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, res.output
    assert f"pip install 'rankwise[{extra}]'" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("tracker,module", [("wandb", "wandb"), ("mlflow", "mlflow"),
                                            ("tensorboard", "tensorboard")])
def test_a_tracker_without_its_package_stops_before_training(monkeypatch, tmp_path, tracker, module):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == module else real(name, *a, **k))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(f"model: {{path: tiny-bert}}\ntrain: {{log_to: [{tracker}]}}\n")
    res = CliRunner().invoke(main, ["train", "cfg.yaml", "--out", "x"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (f"error: train.log_to: {tracker} needs the package {module!r}: "
                                  f"pip install 'rankwise[{tracker}]'")
    assert not (tmp_path / "x").exists()                      # checked before the run folder
