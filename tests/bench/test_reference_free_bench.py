"""``bench orpo`` and ``bench simpo`` (:mod:`rankwise_bench.reference_free`): TRL's batch keys are
our rows, both tasks run TRL's defaults, the record renders for either, and - on a 64-token
vocabulary - the two sides' first steps give the same loss and move the same factors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import rankwise_bench
from rankwise.tasks.pairs import PairData
from rankwise_bench import dpo, reference_free as rf
from tests.tasks.pair_fixtures import pairs, tokenizer


def test_both_are_registered_with_their_own_results_folder():
    from rankwise_bench.regenerate import FOLDERS
    assert rankwise_bench.BENCHMARKS["orpo"].run == "run_orpo" and rankwise_bench.BENCHMARKS["simpo"].run == "run_simpo"
    assert FOLDERS["orpo"] == "orpo" and FOLDERS["simpo"] == "simpo"


def test_trl_batch_holds_the_chosen_then_the_rejected_rows():
    from rankwise.tasks.orpo.task import ORPOTask
    batch = ORPOTask().collate(pairs(n=3), pad_id=0)
    got = rf.trl_batch(batch)
    assert torch.equal(got["chosen_input_ids"], batch["input_ids"][:3])
    assert torch.equal(got["rejected_labels"], batch["labels"][3:])
    assert sorted(got) == sorted(f"{s}_{k}" for s in ("chosen", "rejected") for k in ("input_ids", "attention_mask", "labels"))


@pytest.mark.parametrize("name", ["orpo", "simpo"])
def test_the_tasks_run_the_settings_given_to_trl(name):
    task = rf.task_of(name)
    ours, theirs = rf.SETTINGS[name]
    fields = dataclasses.asdict(task.config)
    assert fields["beta"] == theirs["beta"] == ours["beta"]
    if name == "simpo":
        assert (fields["loss"], fields["gamma"], fields["cpo_alpha"]) == (
            theirs["loss_type"], theirs["simpo_gamma"], theirs["cpo_alpha"])


@pytest.mark.parametrize("name", ["orpo", "simpo"])
def test_the_record_renders_for_either(name):
    row = {"step_cpu_s": {"rankwise": 0.5, "trl": 1.0}, "step_time_ratio": 0.5,
           "peak_step_mb": {"rankwise": 10.0, "trl": 20.0}, "memory_ratio": 0.5,
           "first_loss": {"rankwise": 2.0, "trl": 2.0}, "max_loss_diff_timed_steps": 0.0}
    res = {"rows": {"float32": row}, "setup": {"task": rf.SETTINGS[name][0], "pairs": 64},
           "versions": dict.fromkeys(("python", "torch", "transformers", "peft", "trl", "bitsandbytes",
                                      "cpu_count"), "x"), "wall_s": 12.0}
    text = rf.markdown(res)
    assert f"rankwise bench {name} --out bench/results/{name}" in text and rf.TRAINERS[name] in text
    assert "| float32 | train step, median s | 0.5000 | 1.0000 | 0.500 | <= 1.0 |" in text


@pytest.mark.slow  # imports TRL and builds its trainers
@pytest.mark.parametrize("name", ["orpo", "simpo"])
def test_first_steps_agree_on_a_tiny_vocabulary(name, tmp_path):
    """The bench's pairing on a 64-token vocabulary: the first step's losses to 1e-5, and after
    it (one AdamW step each) the LoRA factors to 1e-5."""
    tok = tokenizer()
    ours, trainer = rf._build(name, tok, tmp_path, "float32")
    dpo.check_fp32_adapters(ours, trainer.model)
    data = PairData(pairs(n=16), pad_id=0)
    mine, theirs = rf._steps(name, ours, trainer, data)
    assert mine(0) == pytest.approx(theirs(0), abs=1e-5)
    from rankwise.core.protocol import adapter_modules, factors
    named = dict(trainer.model.named_modules())
    for path, mod in adapter_modules(ours):
        a, b = factors(mod, "default")
        layer = named["base_model.model." + path]
        assert torch.allclose(a, layer.lora_A["default"].weight, atol=1e-5)
        assert torch.allclose(b, layer.lora_B["default"].weight, atol=1e-5)
        assert float(b.detach().abs().max()) > 0                     # B moved off 0
