"""The LoRA-vs-PEFT benchmark's measuring pieces (the full run takes minutes: `make bench`)."""
from __future__ import annotations

import torch

from rankwise_bench import lora_vs_peft as bench


def test_peak_step_bytes_counts_live_tensors():
    def step(k):  # two 4 MB tensors alive at once, then freed
        a = torch.ones(1024, 1024)
        b = a * 2
        del a
        c = b + 1
        return float(c[0, 0])

    peak = bench._peak_step_bytes(step, 0)
    assert 2 * 4 * 2**20 <= peak < 2 * 4 * 2**20 + 64 * 1024


def test_markdown_table_has_the_three_ratios():
    res = {
        "step_time_ratio": 0.9, "memory_ratio": 1.0, "merged_inference_ratio": 1.001,
        "step_time_ratio_min": 0.95, "step_time_ratio_wall": 0.8, "merged_inference_ratio_wall": 1.0,
        "step_time_s": {"rankwise": 0.9, "peft": 1.0}, "step_wall_s": {"rankwise": 1, "peft": 1},
        "peak_step_mb": {"rankwise": 10.0, "peft": 10.0},
        "inference_time_s": {"merged": 1.0, "base": 1.0}, "reps": 8,
        "targets": {"step_time_ratio": 0.95, "memory_ratio": 1.0, "merged_inference_ratio": 1.01},
        "max_loss_diff": 0.0, "merge_max_abs_diff": 1e-8, "wall_s": 60.0, "load_average": [1.0, 2.0],
        "versions": {"python": "3.11", "torch": "2", "transformers": "5", "peft": "0.21",
                     "machine": "x86_64", "cpu_count": 2, "torch_threads": 1, "platform": "linux"},
    }
    text = bench.markdown(res)
    assert "| train step, median s (vs PEFT) | 0.9000 | 1.0000 | 0.900 | <= 0.95 |" in text
    assert "0.950" in text and "Load average" in text and "--out bench/results/lora-vs-peft" in text
    assert "fused" not in text  # a record without the fused side keeps its form
    res["step_time_s"]["fused"], res["peak_step_mb"]["fused"] = 0.85, 9.0
    res["targets"].update(fused_step_time_ratio=0.9, fused_memory_ratio=1.0)
    res.update(fused_step_time_ratio=0.85, fused_memory_ratio=0.9, fused_step_time_ratio_min=0.8,
               fused_vs_plain_step_ratio=0.85 / 0.9, fused_max_loss_diff=0.0)
    text = bench.markdown(res)
    assert "| train step, median s (fused vs PEFT) | 0.8500 | 1.0000 | 0.850 | <= 0.9 |" in text
    assert "| peak step memory, MiB (fused vs PEFT) | 9.0 | 10.0 | 0.900 | <= 1.0 |" in text
    assert "fused / plain step 0.944" in text
