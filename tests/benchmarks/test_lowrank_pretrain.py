"""The lowrank-pretrain benchmark end to end at a toy size: files written, state bytes equal
the formulas for every optimizer (the peer included when installed)."""
import json

import pytest

from rankwise.benchmarks.lowrank_pretrain import METHODS, Sizes, load_corpus, run


def test_corpus_split_is_by_module():
    train, held, info = load_corpus()
    assert info["files"]["heldout"] > 0 and info["bytes"]["train"] == train.numel()
    assert 0.03 < held.numel() / (train.numel() + held.numel()) < 0.3


@pytest.mark.slow
def test_benchmark_runs_and_state_bytes_match_formulas(tmp_path):
    s = Sizes(hidden=16, layers=1, heads=2, intermediate=32, seq=16, batch=2, steps=3,
              eval_windows=2, rank=4, update_every=2, lrs={m: [1e-3] for m in METHODS})
    try:
        import galore_torch  # noqa: F401
        methods = METHODS
    except ImportError:
        methods = tuple(m for m in METHODS if m != "galore-torch")
    result = run(tmp_path, s, methods)
    for name in ("results.json", "results.md", "loss_curves.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert set(json.loads((tmp_path / "results.json").read_text())["best"]) == set(methods)
    for r in result["runs"]:
        assert r["state_bytes"] == r["formula_bytes"], r["method"]
