"""``torchrun --nproc-per-node 2 -m rankwise train``: two gloo processes on CPU give the metrics
of one process on variable-length data (ddp and FSDP2), only rank 0 writes, ``--resume`` works
(each process gets its own RNG stream back), a different world size is refused, and a dead or
stuck process ends the other with one line instead of a hang."""
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
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from rankwise.cli import main
from rankwise.recipes.config import load_run_config
from rankwise.recipes.train import train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = {  # prompt-completion on real text: variable lengths, masked prompts
    "model": {"path": "tiny-llama", "task": "causal-lm"},
    "data": {"source": "stdlib-functions", "format": "prompt-completion", "max_length": 48, "limit": 64},
    "method": {"name": "lora", "r": 4},
    "optim": {"name": "adamw", "lr": 0.01},
    "train": {"steps": 4, "batch_size": 8, "grad_accum": 2, "save_every": 2, "log_every": 1,
              "progress": False},
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(tmp: Path, out: Path, *sets: str, n: int = 2, resume: bool = False,
             raw: dict = RUN) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node n -m rankwise train`` (``n == 1``: plain ``python -m rankwise``)."""
    cfg = tmp / "run.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    launch = (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"] if n > 1 else [])
    cmd = [sys.executable, *launch, "-m", "rankwise", "train", str(cfg), "--out", str(out),
           *[x for s in sets for x in ("--set", s)]]
    return subprocess.run(cmd + (["--resume"] if resume else []), env=ENV, capture_output=True,
                          text=True, timeout=400)


def losses(run: Path) -> list[float]:
    return [e["loss"] for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if "loss" in e]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "run"
    train(load_run_config(None, base=json.loads(json.dumps(RUN))), out)
    return out


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_processes_give_the_single_process_metrics(tmp_path, single, kind):
    """The fsdp run also schedules with Skrull (data.schedule: skrull regroups each global step
    over 2 processes x 2 micro-batches by cost, the same number of forwards per process): it
    still gives the unscheduled single process's losses and adapter. Both computes the loss in
    chunks of 16 target tokens (train.loss_chunk_tokens; the single process does not): chunked
    loss under ddp and FSDP2 gives the unchunked single process's numbers."""
    extra = (["data.schedule=skrull"] if kind == "fsdp" else []) + ["train.loss_chunk_tokens=16"]
    proc = torchrun(tmp_path, tmp_path / "two", f"train.distributed={kind}", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads((single / "metrics.json").read_text())
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    for key in ("eval_loss", "eval_perplexity"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
    assert two["trainable_params"] == one["trainable_params"] and two["total_params"] == one["total_params"]
    assert losses(tmp_path / "two") == pytest.approx(losses(single), rel=1e-5)   # one line per step: rank 0 only
    events = (tmp_path / "two" / "events.jsonl").read_text()
    assert events.count('"event": "data"') == 1
    a, b = load_file(str(single / "adapter" / "adapter.safetensors")), \
        load_file(str(tmp_path / "two" / "adapter" / "adapter.safetensors"))
    assert sorted(a) == sorted(b) and all((a[k] - b[k]).abs().max() < 1e-5 for k in a)   # full tensors


def test_dpo_two_processes_give_the_single_process_metrics(tmp_path):
    """model.task dpo: each process scores its share of the pairs against the adapters-off
    reference; the step losses (one per pair, normalised by the pairs of the whole step) and the
    evaluation's reward metrics equal one process's."""
    from test_dpo_run import pair_records, raw_config
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in pair_records()))
    raw = raw_config(pairs, steps=3)
    raw["train"].update(batch_size=8, grad_accum=2, save_every=0)
    one = train(load_run_config(None, base=json.loads(json.dumps(raw))), tmp_path / "one")
    proc = torchrun(tmp_path, tmp_path / "two", raw=raw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    for key in ("eval_loss", "eval_reward_margin", "eval_reward_accuracy", "eval_logps_chosen"):
        # log-probs are float32 sums of magnitude ~10-100 taken in another order: 1e-5 absolute
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-5), key
    assert one["eval_reward_margin"] != 0.0                            # the adapters moved
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)


def test_grpo_two_processes_give_the_single_process_metrics(tmp_path):
    """model.task grpo: each micro-batch samples from a seed of (train.seed, step, its place among
    the step's micro-batches over all processes), so 2 processes x 1 micro-batch sample the groups
    of 1 process x 2 (grad_accum: 2): the same step losses, adapter and eval_reward_mean
    (measured: equal losses, adapters within 2e-8). The logged step reward is rank 0's share."""
    from test_dpo_run import grpo_raw
    raw = grpo_raw(tmp_path, steps=2)
    raw["train"].update(batch_size=4, grad_accum=2, save_every=0)   # 4 prompts x G=3 per step
    one = train(load_run_config(None, base=json.loads(json.dumps(raw))), tmp_path / "one")
    proc = torchrun(tmp_path, tmp_path / "two", "train.grad_accum=1", raw=raw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two["eval_reward_mean"] == pytest.approx(one["eval_reward_mean"], rel=1e-6, abs=1e-6)
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5, abs=1e-7)
    assert len(losses(tmp_path / "one")) == 2 and any(x != 0.0 for x in losses(tmp_path / "one"))
    a, b = (load_file(str(tmp_path / p / "adapter" / "adapter.safetensors")) for p in ("one", "two"))
    assert sorted(a) == sorted(b) and all((a[k] - b[k]).abs().max() < 1e-6 for k in a)
    assert all(a[k].abs().max() > 0 for k in a if "lora_B" in k)    # the adapters moved (B starts at 0)


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


def test_fsdp2_over_a_4bit_base_gives_the_single_process_metrics(tmp_path):
    """FSDP2 shards a QLoRA model (NF4 codes in a bf16 storage dtype) across 2 gloo processes,
    with DoRA's magnitudes (its norm reads the sharded 4-bit base through the layer's forward)."""
    pytest.importorskip("bitsandbytes")
    q = json.loads(json.dumps(RUN))
    q["model"].update(quantize="nf4", dtype="bfloat16")
    q["method"].update(use_dora=True)
    q["train"].update(precision="bf16", steps=2)
    one = train(load_run_config(None, base=json.loads(json.dumps(q))), tmp_path / "one")
    cfg = tmp_path / "q.yaml"
    cfg.write_text(yaml.safe_dump(q))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", "-m", "rankwise", "train", str(cfg), "--out",
                           str(tmp_path / "two"), "--set", "train.distributed=fsdp"],
                          env=ENV, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    assert two["trainable_params"] == one["trainable_params"]
