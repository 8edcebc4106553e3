"""``train.threads``: torch threads from the CPUs the process may actually use (affinity mask,
cgroup v1/v2 quota), shared by a divisor; checked on fake cgroup trees (issue 18 item 16)."""
from __future__ import annotations

import os

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.engine import threads as T
from rankwise.testing import error_lines


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """An 8-CPU affinity mask, torch at 16 threads, and an empty cgroup tree under tmp_path."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(16)
    root, proc = tmp_path / "cgroup", tmp_path / "proc-self-cgroup"
    root.mkdir()
    proc.write_text("")
    yield root, proc
    torch.set_num_threads(before)


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_affinity_alone_divided(machine):
    root, proc = machine
    assert T.cgroup_cpus(root, proc) is None and T.available_cpus(root, proc) == 8
    assert [T.auto_threads(d, root, proc) for d in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_cgroup_v2_quota_and_its_ancestors(machine):
    root, proc = machine
    proc.write_text("0::/user.slice/job\n")
    write(root / "user.slice/job/cpu.max", "max 100000\n")         # no limit here...
    write(root / "user.slice/cpu.max", "250000 100000\n")          # ...but 2.5 CPUs above
    assert T.cgroup_cpus(root, proc) == 2.5
    assert T.available_cpus(root, proc) == 2 and T.auto_threads(2, root, proc) == 1
    write(root / "user.slice/job/cpu.max", "150000 100000\n")      # the tightest wins: 1.5
    assert T.cgroup_cpus(root, proc) == 1.5 and T.available_cpus(root, proc) == 1


def test_container_sees_its_cgroup_at_the_root(machine):
    root, proc = machine
    proc.write_text("0::/docker/3f2a\n")                            # the host's path, absent here
    write(root / "cpu.max", "400000 100000\n")
    assert T.available_cpus(root, proc) == 4 and T.auto_threads(1, root, proc) == 4


def test_cgroup_v1_cfs_quota(machine):
    root, proc = machine
    proc.write_text("5:memory:/slurm/job1\n4:cpu,cpuacct:/slurm/job1\n")
    write(root / "cpu,cpuacct/slurm/job1/cpu.cfs_quota_us", "300000\n")
    write(root / "cpu,cpuacct/slurm/job1/cpu.cfs_period_us", "100000\n")
    write(root / "memory/slurm/job1/cpu.cfs_quota_us", "100000\n")  # not the cpu controller
    assert T.cgroup_cpus(root, proc) == 3.0 and T.available_cpus(root, proc) == 3
    write(root / "cpu,cpuacct/slurm/job1/cpu.cfs_quota_us", "-1\n")  # unlimited
    assert T.cgroup_cpus(root, proc) is None and T.available_cpus(root, proc) == 8


def test_auto_never_raises_what_torch_was_told(machine):
    root, proc = machine
    torch.set_num_threads(3)                                         # OMP_NUM_THREADS=3, say
    assert T.auto_threads(1, root, proc) == 3 and T.auto_threads(2, root, proc) == 3
    assert T.resolve_threads(6) == 6                                 # a number is taken as given
    with T.use_threads(2) as n:
        assert n == 2 and torch.get_num_threads() == 2
    assert torch.get_num_threads() == 3


GOOD = {"model": {"path": "tiny-bert", "task": "classification"},
        "data": {"source": "demo", "max_length": 16},
        "method": {"name": "lora", "r": 2, "targets": ["query", "value"]},
        "optim": {"name": "adamw", "lr": 0.01},
        "train": {"steps": 2, "batch_size": 4, "progress": False}}


@pytest.mark.slow
def test_train_computes_with_the_auto_choice_and_restores(tmp_path, monkeypatch):
    import rankwise.recipes.train as train_mod
    seen, real = [], train_mod._train

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)
    monkeypatch.setattr(train_mod, "_train", spy)
    monkeypatch.setattr(T, "available_cpus", lambda *a: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")                     # two processes share 4 CPUs
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        cfg = tmp_path / "run.yaml"
        cfg.write_text(yaml.safe_dump(GOOD))
        result = CliRunner().invoke(main, ["train", str(cfg), "--out", str(tmp_path / "a")])
        assert result.exit_code == 0, result.output
        assert seen == [2] and torch.get_num_threads() == 8
        result = CliRunner().invoke(main, ["train", str(cfg), "--out", str(tmp_path / "b"),
                                           "--set", "train.threads=3"])
        assert result.exit_code == 0, result.output
        assert seen == [2, 3] and torch.get_num_threads() == 8
        assert yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())["train"]["threads"] == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value", ["0", "many", "true"])
def test_bad_threads_is_one_line(tmp_path, value):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(GOOD))
    result = CliRunner().invoke(main, ["train", str(cfg), "--out", str(tmp_path / "out"),
                                       "--set", f"train.threads={value}"])
    assert result.exit_code == 2, result.output
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "threads: got" in lines[0], result.stderr
    if value == "0":
        assert lines[0].endswith("train.threads: got 0; expected an integer in 1..4096 or auto"), lines[0]
