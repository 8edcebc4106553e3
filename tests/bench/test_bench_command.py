"""``rankwise bench`` finds the benchmarks in the source checkout (they are not in the installed
package), dispatches ``NAME [--out DIR] [options]`` through ``rankwise_bench.main``, and ends
every user error in one line with exit code 2."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from click.testing import CliRunner

import rankwise_bench
from rankwise.cli import main


def test_without_a_name_it_lists_every_benchmark():
    res = CliRunner().invoke(main, ["bench"])
    assert res.exit_code == 0, res.output
    assert all(name in res.output for name in rankwise_bench.BENCHMARKS)


@pytest.mark.parametrize("args, says", [
    (["bench", "lowrank-pretrian"], "did you mean 'lowrank-pretrain'"),
    (["bench", "dpo", "--rows", "x"], "rankwise bench dpo takes only --out DIR; got --rows x"),
])
def test_a_wrong_name_or_option_is_one_line(args, says):
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_out_alone_runs_the_committed_size_and_options_go_to_the_benchmarks_own_command_line(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(importlib.import_module("rankwise_bench.grpo_gain"), "run",
                        lambda out, **kw: calls.append((out, kw)))
    assert rankwise_bench.main(["grpo-gain", "--out", str(tmp_path)]) == 0
    assert rankwise_bench.main(["grpo-gain", "--lr", "0.003", "--steps", "40"]) == 0
    assert calls == [(tmp_path, {}), (Path("bench/results/grpo-gain"), {"lr": 0.003, "steps": 40, "seeds": 3})]


def test_an_installed_wheel_without_a_checkout_names_the_fix(monkeypatch, tmp_path):
    from rankwise.commands import bench as bench_command
    wheel = tmp_path / "site-packages" / "rankwise" / "commands" / "bench.py"
    monkeypatch.setattr(bench_command, "__file__", str(wheel))
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["bench", "dpo"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "source checkout (bench/rankwise_bench)" in res.output and "clone the rankwise repository" in res.output


@pytest.mark.parametrize("name", sorted(rankwise_bench.BENCHMARKS))
def test_every_entry_names_functions_that_exist(name):
    entry = rankwise_bench.BENCHMARKS[name]
    module = importlib.import_module(f"rankwise_bench.{entry.module}")
    assert callable(getattr(module, entry.run))
    assert entry.cli is None or callable(getattr(module, entry.cli))
    assert callable(getattr(module, "markdown", None)) or name == "federated-demo"   # the library writes its table
