"""``rankwise bench llm-finetune`` and ``bench/gpu/llm-finetune.sh`` at a tiny size on CPU."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from rankwise_bench.llm_finetune import PRESETS, ROWS, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_run_compares_both_sides_from_the_same_weights(tmp_path):
    sizes = dataclasses.replace(PRESETS["tiny"], rows=("fp32", "bf16", "nf4+ckpt"))
    res = run(tmp_path, sizes)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["rows"]) == {"fp32", "bf16", "nf4+ckpt"} and saved["memory_meter"] == "cpu_live_tensors"
    rows = res["rows"]
    assert rows["fp32"]["max_loss_diff"] < 1e-5          # same weights, same LoRA init, same steps
    assert rows["bf16"]["max_loss_diff"] < 1e-2          # bf16 rounding only
    for row in rows.values():
        for side in ("rankwise", "peft"):
            r = row[side]
            assert r["peak_bytes"] == r["held_bytes"] + r["step_peak_bytes"] and r["step_peak_bytes"] > 0
            assert r["tokens_per_s"] > 0 and len(r["step_s_all"]) == sizes.steps
        assert row["memory_ratio"] == row["rankwise"]["peak_bytes"] / row["peft"]["peak_bytes"]
    # PEFT's prepare_model_for_kbit_training keeps fp32 copies of norms and embeddings
    assert rows["nf4+ckpt"]["rankwise"]["held_bytes"] < rows["nf4+ckpt"]["peft"]["held_bytes"]
    assert rows["nf4+ckpt"]["base_weight_bytes"] < rows["bf16"]["base_weight_bytes"]
    md = (tmp_path / "results.md").read_text()
    assert "| nf4+ckpt |" in md and "cpu_live_tensors" in md


@pytest.mark.integration
@pytest.mark.slow
def test_gpu_script_runs_on_cpu_at_tiny_size(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "gpu"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "llm-finetune.sh"), str(out),
                           "--preset", "tiny", "--set", "device=cpu", "--set", "rows=[bf16,nf4]",
                           "--set", "steps=1"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert set(res["rows"]) == {"bf16", "nf4"} and res["sizes"]["hidden"] == 64
    assert "--preset gpu-1b" in res["command"] and res["nf4_base_bytes_ratio"] < 1.0
    gpu = PRESETS["gpu-1b"]
    assert (gpu.hidden, gpu.layers, gpu.seq, gpu.batch) == (2048, 16, 1024, 8)
    assert set(gpu.rows) <= set(ROWS) and {"bf16", "nf4"} <= set(gpu.rows)


def test_compiled_without_the_fused_side_is_one_line(tmp_path):
    from rankwise.errors import RankwiseError
    with pytest.raises(RankwiseError, match="set fused=true and warmup >= 1"):
        run(tmp_path, dataclasses.replace(PRESETS["tiny"], compiled=True))


def test_gpu_preset_without_a_gpu_is_one_line(tmp_path, capsys):
    import torch

    from rankwise_bench.llm_finetune import main
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "gpu"), "--preset", "gpu-1b"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "no CUDA GPU" in err[0]
    assert not (tmp_path / "gpu").exists()


def test_liger_peer_without_cuda_or_the_package_is_one_line(tmp_path, capsys):
    """liger-kernel is Triton only (no CPU path): asking for the Liger peer on CPU is refused
    with one line before anything is built."""
    from rankwise_bench.llm_finetune import main
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "l"), "--preset", "tiny", "--set", "liger=true"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "drop --set liger=true" in err[0]
    assert not (tmp_path / "l").exists()


@pytest.mark.slow
def test_dora_rows_compare_both_sides_from_the_same_weights(tmp_path):
    """``dora-`` rows: DoRA on both sides from the same factors and magnitudes, so the fp32 row's
    losses agree with PEFT's step by step."""
    from rankwise_bench.llm_finetune import PRESETS as P
    sizes = dataclasses.replace(P["tiny"], rows=("dora-fp32",), steps=1, gora_batches=0)
    rows = run(tmp_path, sizes)["rows"]
    assert rows["dora-fp32"]["max_loss_diff"] < 1e-5 and len(rows["dora-fp32"]["peft"]["losses"]) == 2
    assert "use_dora=True" in rows["dora-fp32"]["peft_setup"]
    assert set(P["cpu-dora"].rows) == {"dora-" + r for r in ROWS}
    assert "`dora-` rows: DoRA" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_fused_side_steps_with_the_plain_path_and_peft(tmp_path):
    """``fused=True``: a third model per row (``train.fused_lora: auto``) from the same weights
    and init, whose losses equal the plain path's (fp32) step by step; ``compiled=True``: a
    fourth, the fused model compiled, whose losses equal the fused eager ones."""
    sizes = dataclasses.replace(PRESETS["tiny"], rows=("fp32", "nf4+ckpt"), steps=1,
                                gora_batches=0, fused=True, compiled=True, compile_backend="aot_eager")
    rows = run(tmp_path, sizes)["rows"]
    assert rows["fp32"]["compiled_vs_fused_max_loss_diff"] < 1e-5
    assert rows["nf4+ckpt"]["compiled_vs_fused_max_loss_diff"] < 1e-2
    for row in rows.values():
        assert row["compiled"]["compile_s"] > 0 and len(row["compiled"]["step_s_all"]) == 1
        assert row["best_path"] in ("rankwise", "fused", "compiled")
        assert row["best_step_time_ratio"] == min(
            row[k]["step_s"] for k in ("rankwise", "fused", "compiled")) / row["peft"]["step_s"]
    assert PRESETS["gpu-1b"].compiled and PRESETS["gpu-1b"].fused
    assert "Compiled fused path" in (tmp_path / "results.md").read_text()
    assert rows["fp32"]["fused_vs_plain_max_loss_diff"] < 1e-6 and len(rows["fp32"]["fused"]["losses"]) == 2
    assert rows["nf4+ckpt"]["fused_vs_plain_max_loss_diff"] < 1e-2   # bf16 compute
    for row in rows.values():
        assert row["fused_memory_ratio"] == row["fused"]["peak_bytes"] / row["peft"]["peak_bytes"]
    assert PRESETS["cpu-fused"].fused and set(PRESETS["cpu-fused"].rows) == set(ROWS)
    assert "Fused LoRA path" in (tmp_path / "results.md").read_text()
