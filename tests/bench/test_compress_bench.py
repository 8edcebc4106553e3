"""The compression benchmark: budget arithmetic (fast) and a tiny end-to-end run (slow)."""
import json

import pytest

from rankwise_bench.compress import Sizes, budget_sparsity, rows, run, svd_rank


def test_budget_matched_sparsity_gives_the_same_total_parameters():
    shapes = [(128, 128), (256, 128), (128, 256)]
    s = budget_sparsity(shapes, 0.5, 8)
    total = sum(m * n for m, n in shapes)
    assert (1 - s) * total == pytest.approx(0.5 * total + sum(8 * (m + n) for m, n in shapes))
    k = svd_rank(shapes)
    assert abs(k * sum(m + n for m, n in shapes) / total - 0.5) < 0.01


def test_rows_cover_every_method_at_both_patterns_and_bits():
    labels = [label for label, _ in rows(Sizes(), [(128, 128)])]
    for m in ("magnitude", "wanda", "sparsegpt", "3basil"):
        assert f"{m} 50%" in " ".join(labels) and f"{m} 2:4" in " ".join(labels)
    for m in ("rtn", "gptq", "glvq"):
        assert f"{m} int4" in labels and f"{m} int3" in labels


def test_kv_rows_add_kivi_at_nsnquants_stored_bytes():
    from rankwise_bench.compress import kv_rows
    from rankwise.compress.kv import bits_per_element
    got = kv_rows(32, 16)
    # NSNQuant at d=32, chunk 16 stores 1 + 1 + 1 = 3 and 4 bits/element; KIVI 2-bit and
    # 3-bit with 32-token key groups store 2 (3) + (32/32 + 32/32)/2 = 3 (4): equal bytes
    assert got[-2:] == [("kivi", 2, 32), ("kivi", 3, 32)]
    for (_, nb, _), (kind, b, c) in zip([r for r in got if r[0] == "nsnquant"], got[-2:]):
        assert bits_per_element(kind, b, 32, c) == bits_per_element("nsnquant", nb, 32, 16)


@pytest.mark.slow
def test_tiny_benchmark_writes_results_and_plot(tmp_path):
    s = Sizes(models=("llama",), llama_steps=20, llama_seq=32, calib_windows=4, heldout_windows=4, kv_batch=4,
              overrides={"3basil": {"iterations": 10, "min_iterations": 10, "tm_epochs": 1},
                         "glvq": {"rounds": 1, "steps": 1}})
    res = run(tmp_path, s)
    assert {p.name for p in tmp_path.iterdir()} >= {"results.json", "results.md", "quality_vs_bytes.png"}
    assert not (tmp_path / "_work").exists()
    llama = json.loads((tmp_path / "results.json").read_text())["models"]["llama"]
    assert len(llama["rows"]) == len(res["models"]["llama"]["rows"]) == 20
    assert [r["kind"] for r in llama["kv_cache"]] == ["fp", "nsnquant", "nsnquant", "kivi", "kivi", "kivi",
                                                      "kivi", "kivi"]
    assert "stored bits / element" in (tmp_path / "results.md").read_text()
