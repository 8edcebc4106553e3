"""``bench tpa``: the paper's head-count rule and a tiny run of the whole benchmark."""
from __future__ import annotations

import json

import pytest
import torch

from rankwise_bench.tpa import ROWS, attention_params, build, matched_heads, run, tiny
from rankwise_bench.tpa.rows import Sizes


def test_head_rule_reproduces_the_papers_medium_configs():
    """Appendix H (d = 1024, d_h = 64, R_Q = 6, R_K = R_V = 2, GQA with 2 KV heads)."""
    got = {r: matched_heads(r, 1024, 64) for r in ROWS}
    assert got == {"mha": 16, "gqa": 30, "mqa": 31, "tpa": 47, "tpa-kvonly": 29}


@pytest.mark.parametrize("row", ROWS)
def test_rows_have_mhas_attention_parameters_up_to_head_rounding(row):
    s = Sizes()
    model = build(row, s)
    per_layer = attention_params(model) // s.layers
    assert per_layer == {"mha": 65536, "gqa": 65536, "mqa": 65536, "tpa": 67840, "tpa-kvonly": 68608}[row]
    assert abs(per_layer / (4 * s.hidden ** 2) - 1) < 0.05    # 4 d² = 65,536 at d = 128


@pytest.mark.slow
def test_tiny_run_measures_the_table_1_cache(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    corpus = torch.randint(0, 256, (4000,), generator=g, dtype=torch.uint8)
    from rankwise_bench import corpus as data
    monkeypatch.setattr(data, "load_corpus", lambda: (corpus[:3000], corpus[3000:],
                                                      {"bytes": {"train": 3000, "heldout": 1000}}))
    result = run(tmp_path, tiny())
    rows = result["rows"]
    assert list(rows) == list(ROWS)
    for r in rows.values():   # measured on the cache after a prefill == (R_K+R_V)(h+d_h) or 2 G d_h, × 4 bytes
        assert r["kv_bytes_per_token_layer"] == r["kv_formula_bytes"]
        assert len(r["train_curve"]) == 3 and r["decode_tok_s"] > 0
    assert rows["tpa"]["kv_formula_bytes"] == 4 * (2 + 2) * (3 + 8)      # h = 3 at d = 32, d_h = 8
    assert rows["mqa"]["kv_formula_bytes"] == 4 * 2 * 8
    assert json.loads((tmp_path / "results.json").read_text())["rows"]["gqa"]["kv_heads"] == 2
    assert (tmp_path / "tpa.png").stat().st_size > 0 and "| tpa |" in (tmp_path / "results.md").read_text()
