"""Bad real-scale settings (dtype, quantization, precision, checkpointing, accumulation): one
line on stderr naming the fix, exit code 2, nothing written."""
from __future__ import annotations

import importlib.util
import traceback
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.testing import error_lines

GOOD = {
    "model": {"path": "tiny-llama", "task": "causal-lm"},
    "data": {"source": "demo", "max_length": 16, "limit": 16},
    "method": {"name": "lora"},
    "optim": {"name": "adamw", "lr": 0.01},
    "train": {"steps": 1, "batch_size": 4, "progress": False},
}


def train_with(tmp_path: Path, *sets: str):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(GOOD))
    args = ["train", str(cfg), "--out", str(tmp_path / "out")]
    for s in sets:
        args += ["--set", s]
    return CliRunner().invoke(main, args)


def assert_one_line(result, *needles: str) -> None:
    assert isinstance(result.exception, SystemExit), result.exc_info and "".join(
        traceback.format_exception(*result.exc_info))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("sets, needles", [
    (["train.grad_accum=3"], ["train.grad_accum: got 3", "does not divide batch_size 4", "such as 2"]),
    (["train.grad_accum=0"], ["train.grad_accum: got 0", ">= 1"]),
    (["model.dtype=float8"], ["model.dtype: got 'float8'", "'bfloat16'"]),
    (["model.dtype=bfloat"], ["did you mean 'bfloat16'"]),
    (["model.quantize=nf5"], ["model.quantize: got 'nf5'", "did you mean 'nf4'"]),
    (["train.precision=bf32"], ["train.precision: got 'bf32'"]),
    (["model.quantize=nf4", "method.name=full"], ["trains every weight", "model.quantize: null"]),
    (["model.dtype=bfloat16"], ["train.precision fp32", "set train.precision: bf16"]),
], ids=["accum-divides", "accum-zero", "dtype", "dtype-typo", "quantize", "precision",
        "full-on-4bit", "half-base-fp32-compute"])
def test_bad_settings_are_one_line(tmp_path, sets, needles):
    assert_one_line(train_with(tmp_path, *sets), *needles)
    assert not (tmp_path / "out").exists()


def test_quantize_without_bitsandbytes_names_the_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "bitsandbytes" else real(name, *a, **k))
    assert_one_line(train_with(tmp_path, "model.quantize=nf4"),
                    "bitsandbytes", "pip install 'rankwise[quant]'")


def test_fp16_on_a_device_that_cannot_run_it(tmp_path, monkeypatch):
    import rankwise.engine.precision as loop

    def no_half(precision, dtype, device):
        raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
    monkeypatch.setattr(loop, "_probe", no_half)
    assert_one_line(train_with(tmp_path, "train.precision=fp16", "model.dtype=float16"),
                    "train.precision fp16", "cpu cannot run torch.float16", "bf16 or fp32")


def test_checkpointing_a_model_that_does_not_support_it(tmp_path, monkeypatch):
    from transformers import LlamaPreTrainedModel
    monkeypatch.setattr(LlamaPreTrainedModel, "supports_gradient_checkpointing", False)
    assert_one_line(train_with(tmp_path, "train.gradient_checkpointing=true"),
                    "LlamaForCausalLM does not support activation checkpointing",
                    "train.gradient_checkpointing: false")
