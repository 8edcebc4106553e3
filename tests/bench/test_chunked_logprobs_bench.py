"""The chunked-logprobs benchmark at a tiny size: for each of its tasks (DPO, KTO, ORPO, SimPO,
GRPO, RLOO) the chunked side peaks at least 30 % below the unchunked one at the same loss, and
the Markdown renders from the record."""
from __future__ import annotations

import pytest

from rankwise_bench import chunked_logprobs as cl

TINY = cl.Sizes(vocab=4000, seq=96, prompt=32, chunk_tokens=16, warmup=0)  # 12 measured steps


@pytest.fixture(scope="module")
def measured() -> dict:
    return cl.measure_all(TINY)


@pytest.mark.parametrize("name", cl.TASKS)
def test_tiny_sizes_save_memory_at_equal_losses(measured, name):
    r = measured[name]
    assert r["saving"] >= cl.GOAL, r
    assert r["loss_abs_diff"] <= 1e-5 * max(1.0, abs(r["unchunked"]["loss"]))
    assert r["chunked"]["held_bytes"] == r["unchunked"]["held_bytes"] > 0
    if name == "rloo":                                       # leave-one-out advantages sum to 0
        assert abs(r["unchunked"]["loss"]) < 1e-6
    else:                                                    # GRPO's unequal completions: a real loss
        assert abs(r["unchunked"]["loss"]) > 1e-3


def test_results_md_renders_the_record(measured):
    res = {**measured, "command": "rankwise bench chunked-logprobs --out x", "timer": "t",
           "meter": "cpu_live_tensors", "definition": "d", "versions": {"torch": "2"}, "wall_s": 1.0}
    md = cl.markdown(res)
    assert all(md.count(f"| {name} |") == 2 for name in cl.TASKS) and "NOT held" not in md
