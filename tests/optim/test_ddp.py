"""DDP equality: 2 processes (torchrun, gloo, CPU) on half batches give the parameters of one
process on the whole batch, for every low-rank optimizer."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from ddp_worker import SETTINGS, run_steps  # noqa: E402


@pytest.mark.integration
@pytest.mark.slow
def test_two_process_ddp_matches_single_process(tmp_path):
    out = tmp_path / "ddp.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).parent / "ddp_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = torch.load(out, weights_only=True)
    for name in SETTINGS:
        ref = run_steps(name)
        for key, value in ref.items():
            assert torch.allclose(ddp[name][key], value, atol=2e-5, rtol=1e-4), (name, key)
