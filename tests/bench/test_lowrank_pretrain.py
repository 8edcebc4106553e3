"""The lowrank-pretrain benchmark end to end at a toy size: files written, state bytes equal
the registry's formulas for every row (the peer included when installed), rows built from the
registry entries, the size presets, and the 1B GPU script run on CPU at a toy size."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rankwise import registry
from rankwise_bench.corpus import ByteWindows, load_corpus
from rankwise_bench.lowrank_pretrain import METHODS, ROWS, SIZES, Sizes, build_model, prepared_model, run
from rankwise_bench.lowrank_pretrain.__main__ import parse

REPO = Path(__file__).resolve().parents[2]
TINY = ["--set", "device=cpu", "--set", "precision=bf16", "--set", "hidden=16", "--set", "layers=1",
        "--set", "heads=2", "--set", "intermediate=32", "--set", "seq=16", "--set", "batch=2",
        "--set", "steps=2", "--set", "eval_windows=2", "--set", "rank=4", "--set", "update_every=2",
        "--set", "lrs=[1e-3]", "--set", "threads=1"]


def test_corpus_split_is_by_module():
    train, held, info = load_corpus()
    assert info["files"]["heldout"] > 0 and info["bytes"]["train"] == train.numel()
    assert 0.03 < held.numel() / (train.numel() + held.numel()) < 0.3


def test_rows_take_sizes_grids_and_formulas_from_the_registry():
    s = Sizes(rank=7, update_every=11, eps=1e-5)
    galore = ROWS["galore-eigh"].config(1e-2, s)
    assert (galore.name, galore.rank, galore.update_every, galore.eps, galore.svd, galore.stagger) == \
        ("galore", 7, 11, 1e-5, "eigh", True)
    q3r = ROWS["q3r"].config(1e-3, s)   # keeps its own reweighting period
    assert (q3r.rank, q3r.update_every) == (7, registry.get("optimizer", "q3r").config_cls().update_every)
    assert not hasattr(ROWS["ngn-m"].config(0.3, s), "rank")
    assert ROWS["adamw"].grid(s) == (1e-3, 3e-3, 1e-2)
    assert ROWS["adamw-split"].grid(s) == registry.get("optimizer", "galore").lr_grid
    assert ROWS["sumo"].grid(Sizes(lrs=(5e-3,))) == (5e-3,)
    assert {r.optimizer for r in ROWS.values()} <= set(registry.names("optimizer"))


def test_byte_windows_are_causal_lm_examples():
    import torch
    data = torch.arange(100, dtype=torch.uint8)
    ds = ByteWindows(data, torch.tensor([[3, 50], [10, 0]]), 4)
    assert len(ds) == 4 and ds[1] == {"input_ids": [50, 51, 52, 53]} and ds.pad_id == 0


@pytest.mark.slow
def test_benchmark_runs_and_state_bytes_match_formulas(tmp_path):
    s = Sizes(hidden=16, layers=1, heads=2, intermediate=32, seq=16, batch=2, steps=3,
              eval_windows=2, rank=4, update_every=2, lrs=(1e-3,))
    methods = tuple(m for m in METHODS
                    if ROWS[m].requires is None or importlib.util.find_spec(ROWS[m].requires))
    result = run(tmp_path, s, methods)
    for name in ("results.json", "results.md", "loss_curves.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert set(json.loads((tmp_path / "results.json").read_text())["best"]) == set(methods)
    assert len(result["runs"]) == len(methods)
    for r in result["runs"]:
        assert r["state_bytes"] == r["formula_bytes"], r["method"]
        assert len(r["train_curve"]) == 3 and not r["diverged"], r["method"]
        # untrained byte model: loss near ln(256) = 5.545 nats per byte
        assert all(5.0 < x < 6.0 for x in r["train_curve"]), (r["method"], r["train_curve"])
        assert 5.0 < r["heldout_loss"] < 6.0 and r["opt_step_s"] > 0 and math.isfinite(r["step_s"])


def test_presets_and_the_command_line():
    assert sum(p.numel() for p in build_model(Sizes(**{**SIZES["1b"].__dict__, "device": "meta"})).parameters()) \
        == 1_209_059_328
    out, s, rows = parse(["--out", "x", "--size", "medium", "--set", "steps=7", "--rows", "adamw,sumo"])
    assert (out, s.hidden, s.steps, rows) == ("x", 256, 7, ("adamw", "sumo"))
    with pytest.raises(Exception, match="expected FIELD=VALUE with a field of"):
        parse(["--out", "x", "--set", "stepz=3"])


def test_lowrank_rows_factorize_the_blocks_and_train_everything_else():
    s = Sizes(hidden=16, layers=1, heads=2, intermediate=32, seq=16, rank=4)
    model = prepared_model("lowrank-hb", s)
    from rankwise.adapters.lowrank import LowRankLayer
    layers = [m for m in model.modules() if isinstance(m, LowRankLayer)]
    assert len(layers) == 7 and all(m.modes["default"] == "factorized" for m in layers)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(n.endswith("base_layer.weight") for n in frozen)   # the released weights


@pytest.mark.integration
@pytest.mark.slow
def test_gpu_script_runs_on_cpu_at_a_toy_size(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "ROWS": "adamw,galore-oja,lowrank-hb,nanoadam",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(REPO / "bench/gpu/lowrank-pretrain.sh"), str(tmp_path / "out"), *TINY],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert result["sizes"]["precision"] == "bf16" and result["sizes"]["layers"] == 1
    assert set(result["best"]) == {"adamw", "galore-oja", "lowrank-hb", "nanoadam"}
    assert all(math.isfinite(r["heldout_loss"]) for r in result["runs"])
