"""``task: {name: reward}`` with the run options ``dpo`` supports: other adapter methods (DoRA,
prompt tuning, a frozen base whose head alone trains, full fine-tuning), gradient accumulation
and checkpointing (the same step losses as one plain batch), a QLoRA base (NF4, its ``score``
head left in float) and two torchrun processes (the single process's metrics). Each run's
evaluation metrics are those of its saved model, recomputed pair by pair."""
from __future__ import annotations

import json

import pytest

from rankwise.recipes.config import load_run_config
from rankwise.recipes.train import train
from tests.recipes.torchrun_helpers import losses, torchrun
from tests.tasks.reward.test_reward_run import hand_metrics, raw_config, run, write_pairs

pytestmark = pytest.mark.slow  # every test trains through the recipe


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs"))


def check(out, metrics: dict, tol: float = 1e-5) -> None:
    for key, value in hand_metrics(out).items():
        assert metrics[key] == pytest.approx(value, abs=tol), key


@pytest.mark.parametrize("method", [
    {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"], "use_dora": True},
    {"name": "prompt-tuning", "num_virtual_tokens": 4},
    {"name": "frozen"},
    {"name": "full"},
])
def test_other_methods_train_the_reward_head_and_their_metrics_are_the_saved_models(method, pairs, tmp_path):
    out = tmp_path / "run"
    metrics = run(raw_config(pairs, steps=2, method=method), out)
    first = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(first) == 2 and first[0]["loss"] != first[1]["loss"]
    check(out, metrics)


def test_accumulation_and_checkpointing_give_one_batchs_losses(pairs, tmp_path):
    raw = raw_config(pairs, steps=3)
    raw["train"]["batch_size"] = 8
    plain = run(raw, tmp_path / "plain")
    raw["train"].update(grad_accum=2, gradient_checkpointing=True)
    split = run(raw, tmp_path / "split")
    assert losses(tmp_path / "split") == pytest.approx(losses(tmp_path / "plain"), rel=1e-5)
    for key in ("eval_loss", "eval_margin", "eval_accuracy"):
        assert split[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key


def test_qlora_keeps_the_head_in_float_and_reports_the_saved_models_metrics(pairs, tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoTokenizer
    from rankwise.recipes.export import load_run
    from rankwise.recipes.model import demo_model_path
    from rankwise.testing import tiny_llama64
    base = tmp_path / "llama64"
    tok = AutoTokenizer.from_pretrained(str(demo_model_path()))
    tiny_llama64(len(tok), pad_token_id=tok.pad_token_id).save_pretrained(base)
    tok.save_pretrained(base)
    raw = raw_config(pairs, steps=2, method={"name": "lora", "r": 4, "targets": "all-linear"})
    raw["model"] = {"path": str(base), "dtype": "bfloat16", "quantize": "nf4"}
    raw["train"]["precision"] = "bf16"
    out = tmp_path / "run"
    metrics = run(raw, out)
    _, model, _ = load_run(out)
    assert type(model.score).__name__ == "Linear" and type(model.model.layers[0].self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    check(out, metrics, tol=2e-2)  # bf16 compute: one pair at a time vs the padded batch


@pytest.mark.integration
def test_two_processes_give_the_single_process_metrics(pairs, tmp_path):
    raw = raw_config(pairs, steps=3)
    raw["train"].update(batch_size=8, grad_accum=2, save_every=0)
    one = train(load_run_config(None, base=json.loads(json.dumps(raw))), tmp_path / "one")
    proc = torchrun(tmp_path, tmp_path / "two", raw=raw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    for key in ("eval_loss", "eval_margin", "eval_accuracy", "eval_mean_reward"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
