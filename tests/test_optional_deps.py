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
