"""The ``orpo`` task against TRL 1.16's ``trl.experimental.orpo.ORPOTrainer`` on a PEFT LoRA of
the same tiny Llama (fp32, the same non-zero factors, the same token batch): the first batch's
loss, every LoRA factor's gradient and TRL's logged metrics to 1e-5; the odds-ratio term against
odds computed from probabilities; bad input in one line."""
from __future__ import annotations

import json
import math

import pytest
import torch

from rankwise.tasks.orpo.task import ORPOConfig, ORPOTask, orpo_losses
from test_cli_errors import assert_user_error, invoke, write_yaml
from tests.tasks.pair_fixtures import assert_same_peer_grads, first_batch_with_trl


def orpo_trainer(beta: float, tmp_path):
    def make(base, peft_config, data, tok):
        from trl.experimental.orpo import ORPOConfig as TrlORPOConfig, ORPOTrainer
        args = TrlORPOConfig(output_dir=str(tmp_path), beta=beta, report_to=[], use_cpu=True, bf16=False,
                             fp16=False, per_device_train_batch_size=4, gradient_checkpointing=False)
        return ORPOTrainer(model=base, args=args, train_dataset=data, processing_class=tok,
                           peft_config=peft_config)
    return make


@pytest.mark.slow  # imports TRL and builds its trainer
@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_first_batch_loss_gradients_and_metrics_equal_trl_orpo_trainer(beta, tmp_path):
    pytest.importorskip("trl")
    task = ORPOTask(ORPOConfig(beta=beta))
    ours, trainer, mine, ref, logged = first_batch_with_trl(task, orpo_trainer(beta, tmp_path))
    assert float(mine.detach()) == pytest.approx(float(ref.detach()), abs=1e-5, rel=1e-5)
    assert assert_same_peer_grads(ours, trainer.model) == 2 * 3 * 2   # A and B of q, v, down in 2 layers
    step = task.step_metrics()
    for key, theirs in (("nll_loss", "nll_loss"), ("log_odds_ratio", "log_odds_ratio"),
                        ("log_odds_chosen", "log_odds_chosen"), ("reward_chosen", "rewards/chosen"),
                        ("reward_rejected", "rewards/rejected"), ("reward_margin", "rewards/margins"),
                        ("reward_accuracy", "rewards/accuracies"), ("logps_chosen", "logps/chosen")):
        assert step[key] == pytest.approx(logged[theirs], abs=1e-5), key
    # the odds-ratio term is in it: the loss is not the NLL alone, by lambda * L_OR
    assert float(mine.detach()) - step["nll_loss"] == pytest.approx(-beta * step["log_odds_ratio"], abs=1e-6)
    assert abs(step["log_odds_chosen"]) > 1e-3


def test_odds_ratio_term_from_probabilities():
    """P_w = 1/2 and P_l = 1/4: odds 1 and 1/3, log odds ratio log 3, L_OR = -log(3/4)."""
    logps = torch.log(torch.tensor([[0.5, 0.25], [0.25, 0.5]]))
    losses, rewards, extras = orpo_losses(logps, beta=0.2)
    assert torch.allclose(extras["log_odds_chosen"], torch.tensor([math.log(3), -math.log(3)]), atol=1e-6)
    assert torch.allclose(losses, -0.2 * torch.log(torch.tensor([0.75, 0.25])), atol=1e-6)
    assert torch.allclose(rewards, 0.2 * logps)


def raw_config(source, **task) -> dict:
    return {"model": {"path": "tiny-llama"}, "task": {"name": "orpo", **task},
            "data": {"source": str(source), "max_length": 32, "eval_fraction": 0.25},
            "method": {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"]},
            "train": {"steps": 1, "batch_size": 4, "progress": False}}


@pytest.mark.parametrize("case", ["no-columns", "beta", "train-on-prompt", "packing"])
def test_bad_input_is_one_line(case, tmp_path):
    recs = [{"prompt": f"def f{i}(x):\n", "chosen": f"    return {i}", "rejected": "    pass"} for i in range(8)]
    if case == "no-columns":                                # SFT records given to a pair task
        recs = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in recs]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    raw = raw_config(path, beta=0.0 if case == "beta" else 0.1)
    if case == "train-on-prompt":
        raw["data"]["train_on_prompt"] = True
    if case == "packing":
        raw["data"]["packing"] = True
    res = invoke("train", write_yaml(tmp_path / "c.yaml", raw), "--out", tmp_path / "run")
    needles = {"no-columns": ("no 'chosen' field", "data.chosen_field"),
               "beta": ("task.beta: got 0.0; expected a value > 0",),
               "train-on-prompt": ("data.train_on_prompt is not supported with task.name: orpo", "task.sft_on_prompt"),
               "packing": ("data.packing is not supported with task.name: orpo",)}[case]
    assert_user_error(res, *needles)
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_section_defaults_are_recorded():
    from rankwise.recipes.config import load_run_config
    cfg = load_run_config(None, base={"model": {"path": "tiny-llama"}, "task": {"name": "orpo"}})
    assert cfg.to_dict()["task"] == {"name": "orpo", "beta": 0.1, "sft_on_prompt": True, "disable_dropout": True}
