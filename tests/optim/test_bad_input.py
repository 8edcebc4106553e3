"""Issue-13 settings a user can get wrong end with one line on stderr and exit code 2."""
import pytest
import yaml
from click.testing import CliRunner

from rankwise.cli import main

BASE = {"model": {"path": "tiny-bert", "task": "classification"},
        "data": {"source": "demo", "max_length": 16, "limit": 16},
        "train": {"steps": 1, "batch_size": 4, "progress": False}}


@pytest.mark.parametrize("method,optim,message", [
    ({"name": "lota-qaf", "bits": 3}, {"name": "t-signsgd"}, "method.bits: got 3; expected one of [2, 4, 8]"),
    ({"name": "lota-qaf", "group_size": 24}, {"name": "t-signsgd"},
     "method.group_size: 24 (capped at the input size) does not divide the input size of"),
    ({"name": "full"}, {"name": "nanoadam", "density": 1.5}, "optim.density: got 1.5; expected a fraction in (0, 1]"),
    ({"name": "full"}, {"name": "nanoadam", "density": 0}, "optim.density: got 0.0"),
    ({"name": "lowrank", "rank": 64}, {"name": "lowrank-hb"}, "lowrank rank 64 is larger than the 32->32 layer"),
    ({"name": "full"}, {"name": "adamw", "projector": "oja"}, "optim.projector: unknown key"),
    ({"name": "full"}, {"name": "q3r", "oja_bits": 8}, "optim.oja_bits: unknown key"),
    ({"name": "full"}, {"name": "galore", "oja_bits": 8}, "optim.oja_bits: got 8 with projector 'svd'"),
    ({"name": "lora"}, {"name": "lowrank-adam"}, "need factorized layers: set method.name: lowrank"),
    ({"name": "full"}, {"name": "adamw", "state_bits": 4}, "optim.state_bits: got 4; the bitsandbytes backend"),
])
def test_one_line_and_exit_2(tmp_path, method, optim, message):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "method": method, "optim": optim}))
    result = CliRunner().invoke(main, ["train", str(cfg), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], result.output
