"""``bench/gpu/offload.sh`` (``rankwise bench offload``) at its tiny CPU size: the
rows, the loss equality, the bytes the checkpointed row moves against a hand count, and the
GPU preset the script runs (it cannot run here: no GPU in the unit tests)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankwise_bench.offload import PRESETS, ROWS, main
from rankwise.testing import error_lines

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_has_every_row_with_equal_losses(tmp_path):
    main(["--out", str(tmp_path), "--preset", "tiny"])
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["rows"]) == set(ROWS) and set(res["compare"]) == {"offload", "ckpt+offload"}
    assert all(c["max_loss_diff"] == 0.0 for c in res["compare"].values())
    s, rows = PRESETS["tiny"], res["rows"]
    # checkpointed: each block's input, the final hidden state (fp32 (B, T, H) each) and the
    # log-softmax of the B (T-1) predicted positions (B (T-1), V)
    assert rows["ckpt+offload"]["moved_bytes_per_step"] == 4 * (
        (s.layers + 1) * s.batch * s.seq * s.hidden + s.batch * (s.seq - 1) * s.vocab) == 112640
    assert rows["offload"]["moved_bytes_per_step"] > 5 * rows["ckpt+offload"]["moved_bytes_per_step"]
    assert rows["plain"]["moved_bytes_per_step"] == rows["ckpt"]["moved_bytes_per_step"] == 0
    assert "| ckpt+offload | ckpt |" in (tmp_path / "results.md").read_text()


def test_the_gpu_script_runs_the_gpu_preset():
    script = (ROOT / "bench" / "gpu" / "offload.sh").read_text()
    assert "-m rankwise_bench offload --preset gpu" in script
    gpu = PRESETS["gpu"]
    assert (gpu.seq, gpu.device, gpu.dtype, gpu.precision) == (2048, "cuda", "bfloat16", "bf16")
    assert set(gpu.rows) == set(ROWS)


def test_gpu_preset_without_a_gpu_is_one_line(tmp_path, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as err:
        main(["--out", str(tmp_path / "gpu")])
    assert err.value.code == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "no CUDA GPU" in lines[0]
