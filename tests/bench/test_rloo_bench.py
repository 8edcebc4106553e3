"""``bench rloo``: both sides take the same steps (their LoRA gradient norms agree step after
step, AdamW in between) on a 1-prompt, k=2 cut of the benchmark, and its Markdown names what the
agreement line compares (RLOO's loss is 0 in value)."""
from __future__ import annotations

import pytest

from rankwise_bench import rloo


@pytest.mark.slow  # imports TRL and builds its trainer
def test_both_sides_take_the_same_steps(tmp_path):
    tok = rloo.tokenizer()
    batches = rloo._batches(tok, 3, 1, 2)
    ours, trainer = rloo._build(tok, tmp_path, "float32", rows=2, k=2)
    rloo.check_fp32_adapters(ours, trainer.model)
    mine, theirs = rloo._steps(ours, trainer, tok, batches, k=2)
    for step in range(3):
        a, b = mine(step), theirs(step)
        assert a > 1e-4 and a == pytest.approx(b, rel=1e-5), step


def test_markdown_names_the_gradient_norm_agreement():
    row = {"step_cpu_s": {"rankwise": 0.5, "trl": 1.0}, "step_time_ratio": 0.5,
           "peak_step_mb": {"rankwise": 10.0, "trl": 20.0}, "memory_ratio": 0.5,
           "first_loss": {"rankwise": 0.25, "trl": 0.25}, "max_loss_diff_timed_steps": 0.0}
    res = {"rows": {"float32": row}, "wall_s": 1.0,
           "versions": {k: "x" for k in ("python", "torch", "transformers", "peft", "trl", "bitsandbytes",
                                         "cpu_count")}}
    text = rloo.markdown(res)
    assert "float32: first-step LoRA gradient norm rankwise 0.250000, TRL 0.250000" in text
    assert "first-step loss" not in text and "| float32 | train step, median s | 0.5000 | 1.0000 | 0.500 |" in text
