"""``torchrun`` when things go wrong: ``--resume`` under two processes (each gets its own RNG
stream back), a different world size refused, a config error printed once, and a dead or stuck
process ending the other with one line instead of a hang."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from tests.recipes.torchrun_helpers import ENV, RUN, losses, torchrun

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_resume_under_torchrun_and_a_world_size_mismatch(tmp_path):
    dropout = "method.dropout=0.1"                     # dropout draws differ per process
    small = "data.eval_fraction=0.05"                  # ~70 held-out records at each end, not ~290
    full = torchrun(tmp_path, tmp_path / "full", dropout, small)
    assert full.returncode == 0, full.stderr[-3000:]
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step-0000004")
    for name in ("metrics.json", "adapter"):
        shutil.rmtree(part / name) if (part / name).is_dir() else (part / name).unlink()
    # one process: refused before any step (in this process: the refusal needs no launch of its own)
    wrong = CliRunner().invoke(main, ["train", str(tmp_path / "run.yaml"), "--out", str(part), "--set", dropout,
                                      "--set", small, "--resume"])
    assert wrong.exit_code == 2 and "resume it with 2" in wrong.stderr.splitlines()[-1], wrong.output[-2000:]
    resumed = torchrun(tmp_path, part, dropout, small, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = json.loads((tmp_path / "full" / "metrics.json").read_text())
    b = json.loads((part / "metrics.json").read_text())
    assert b["eval_loss"] == a["eval_loss"] and losses(part) == losses(tmp_path / "full")


def test_a_config_error_prints_once(tmp_path):
    """Both processes hit the same config error: one ``error:`` line (rank 0's), both exit 2
    (torchrun then adds its own failure report; a process it stopped first shows SIGTERM)."""
    proc = torchrun(tmp_path, tmp_path / "run", "optim.lr=-1")
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "optim.lr" in lines[0], proc.stderr[-3000:]
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
    assert proc.returncode != 0 and "2" in codes and set(codes) <= {"2", "-15"}, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_stuck_process_ends_the_other_with_one_line(tmp_path, how):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(RUN))
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    cmd = [sys.executable, "-m", "rankwise", "train", str(cfg), "--out", str(tmp_path / "run"),
           "--set", "train.steps=1000", "--set", "train.save_every=0",
           "--set", "train.distributed_timeout_s=30",  # room for start-up on a loaded machine
           "--set", "train.distributed_step_timeout_s=10"]  # the kill comes after step 3: no start-up left
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    events = tmp_path / "run" / "events.jsonl"
    deadline = time.time() + 240
    while (time.time() < deadline and procs[0].poll() is None
           and not (events.is_file() and '"step": 3' in events.read_text())):
        time.sleep(0.5)
    try:
        assert events.is_file(), procs[0].communicate(timeout=5)
        os.kill(procs[1].pid, how)
        start = time.time()
        _, err = procs[0].communicate(timeout=120)
        waited = time.time() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 2, err[-2000:]
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "lost the others" in line[0] and "--resume" in line[0], err[-2000:]
    if how == signal.SIGSTOP:   # nothing but the timeout ends this wait: the step one, not start-up's
        assert "train.distributed_step_timeout_s=10s" in line[0], line[0]
    assert waited < (90 if how == signal.SIGSTOP else 45)
