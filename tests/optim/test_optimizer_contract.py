"""The contract every registered optimizer passes; the list comes from the registry, so an
optimizer registered tomorrow is checked without editing this file (its settings, if they
differ from the defaults, are ONE row of ``optim_contract.SPECS``).

Checks, per optimizer and per variant case of ``optim_contract.VARIANTS`` (tiny models built
in code):
1. the entry registers an ``lr_grid`` of three increasing learning rates, and a
   ``state_floats`` formula unless its spec says there is none;
2. a ``state_dict`` saved mid-training (after a subspace refresh) and read back with
   ``torch.load(weights_only=True)`` resumes to bit-identical parameters;
3. the optimizer's state bytes equal ``4 * state_floats(model, config)`` (fp32);
4. (slow) ``rankwise train`` runs with it (tiny-bert, its spec's method) with finite losses;
5. (slow) 2 DDP processes (torchrun, gloo) on half batches end with the parameters of 1 process
   on the whole batch - one launch for every optimizer.
"""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import optim_contract as contract
from ddp_worker import run_steps
from rankwise import registry
from rankwise.data.demo import PACKAGES
from rankwise.optim.common import state_bytes
from rankwise.recipes.config import load_run_config
from rankwise.recipes.train import train

NAMES = contract.cases()


def _steps(name, model, opt, seeds):
    model.train()
    for s in seeds:
        opt.zero_grad()
        model(**contract.batch(name, seed=s)).loss.backward()
        opt.step()


def test_every_spec_row_names_a_registered_optimizer():
    registered = set(registry.names("optimizer"))
    assert set(contract.SPECS) <= registered, "remove rows of optimizers no longer registered"
    assert {v[0] for v in contract.VARIANTS.values()} <= registered
    assert len(registered) >= 8


@pytest.mark.parametrize("name", NAMES)
def test_registers_lr_grid_and_state_formula(name):
    entry = registry.get("optimizer", contract.entry_name(name))
    grid = entry.lr_grid
    assert len(grid) == 3 and 0 < grid[0] < grid[1] < grid[2], grid
    assert (entry.state_floats is not None) == contract.spec(name)["formula"]


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_resumes_bit_identically(name):
    model = contract.model(name)
    opt = contract.build(name, model)
    _steps(name, model, opt, range(4))              # update_every 3: refreshes at steps 1 and 4
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    saved_params = [p.detach().clone() for p in model.parameters()]
    _steps(name, model, opt, range(4, 8))           # the uninterrupted run
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = contract.model(name, seed=123)
    resumed.load_state_dict(saved["model"])
    opt2 = contract.build(name, resumed)
    opt2.load_state_dict(saved["optim"])
    _steps(name, resumed, opt2, range(4, 8))
    moved = 0
    for (n, p), q, before in zip(model.named_parameters(), resumed.parameters(), saved_params):
        assert torch.equal(p, q), n
        moved += not torch.equal(p, before)
    assert moved > 0


@pytest.mark.parametrize("name", NAMES)
def test_state_bytes_equal_the_registered_formula(name):
    entry = registry.get("optimizer", contract.entry_name(name))
    if entry.state_floats is None:
        pytest.skip(f"{name} declares no state formula")
    model = contract.model(name)
    cfg = contract.config(name)
    opt = entry.builder(model, cfg)
    _steps(name, model, opt, range(2))
    floats = entry.state_floats(model, cfg)
    assert floats > 0 and state_bytes(opt) == 4 * floats, (state_bytes(opt) // 4, floats)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_rankwise_train_runs(tmp_path, name):
    cfg = contract.config(name)
    optim = {k: getattr(cfg, k) for k in ("rank", "update_every") if hasattr(cfg, k)}
    raw = {
        "model": {"path": "tiny-bert", "task": "classification"},
        "data": {"source": "demo", "max_length": 24, "limit": 64},
        "method": contract.spec(name)["method"],
        "optim": {"name": contract.entry_name(name), **optim, **contract.spec(name)["config"]},
        "train": {"steps": 4, "batch_size": 8, "save_every": 2, "log_every": 1, "eval_every": 4,
                  "progress": False},
    }
    metrics = train(load_run_config(None, base=raw), tmp_path / name)
    assert metrics["steps"] == 4 and math.isfinite(metrics["eval_loss"])
    events = [json.loads(x) for x in (tmp_path / name / "events.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in events if "loss" in e]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    n_classes = len(PACKAGES)  # the demo task: which of 8 packages a docstring comes from
    assert abs(losses[0] - math.log(n_classes)) < 0.2  # an untrained head is near uniform


@pytest.mark.integration
@pytest.mark.slow
def test_two_process_ddp_matches_single_process(tmp_path):
    out = tmp_path / "ddp.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).parent / "ddp_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = torch.load(out, weights_only=True)
    assert sorted(ddp) == NAMES
    for name in NAMES:
        ref = run_steps(name)
        for key, value in ref.items():
            assert torch.allclose(ddp[name][key], value, atol=2e-5, rtol=1e-4), (name, key)
