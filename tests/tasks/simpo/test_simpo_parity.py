"""The ``simpo`` task against TRL 1.16's ``trl.experimental.cpo.CPOTrainer`` on a PEFT LoRA of
the same tiny Llama (fp32, the same non-zero factors, the same token batch): the first batch's
loss, every LoRA factor's gradient and TRL's logged metrics to 1e-5 for ``loss_type`` simpo
(TRL's defaults, the paper's ``cpo_alpha: 0``, label smoothing), sigmoid (CPO), hinge and ipo;
SimPO's eq. 6 by hand; bad input in one line."""
from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

from rankwise.tasks.simpo.task import SimPOConfig, SimPOTask, simpo_losses
from test_cli_errors import assert_user_error, invoke, write_yaml
from tests.tasks.pair_fixtures import assert_same_peer_grads, first_batch_with_trl

CASES = {  # id: our task section (TRL's CPOConfig: loss_type, beta, simpo_gamma, cpo_alpha, label_smoothing)
    "simpo-trl-defaults": {},
    "simpo-paper": {"beta": 2.0, "gamma": 1.0, "cpo_alpha": 0.0},
    "simpo-smoothed": {"beta": 2.5, "gamma": 0.3, "cpo_alpha": 0.5, "label_smoothing": 0.1},
    "cpo-sigmoid": {"loss": "sigmoid", "beta": 0.5},
    "hinge": {"loss": "hinge", "beta": 0.5},
    "ipo": {"loss": "ipo", "beta": 0.5},
}


def cpo_trainer(cfg: SimPOConfig, tmp_path):
    def make(base, peft_config, data, tok):
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        args = CPOConfig(output_dir=str(tmp_path), loss_type=cfg.loss, beta=cfg.beta, simpo_gamma=cfg.gamma,
                         cpo_alpha=cfg.cpo_alpha, label_smoothing=cfg.label_smoothing, report_to=[],
                         use_cpu=True, bf16=False, fp16=False, per_device_train_batch_size=4,
                         gradient_checkpointing=False)
        return CPOTrainer(model=base, args=args, train_dataset=data, processing_class=tok, peft_config=peft_config)
    return make


@pytest.mark.slow  # imports TRL
def test_trl_defaults_are_ours():
    """beta, simpo_gamma, cpo_alpha, label_smoothing and disable_dropout are TRL's CPOConfig
    defaults (the loss defaults to simpo: it is this task's name)."""
    from trl.experimental.cpo import CPOConfig
    import dataclasses
    theirs = {f.name: f.default for f in dataclasses.fields(CPOConfig)}
    ours = SimPOConfig()
    assert (ours.beta, ours.gamma, ours.cpo_alpha, ours.label_smoothing, ours.disable_dropout) == (
        theirs["beta"], theirs["simpo_gamma"], theirs["cpo_alpha"], theirs["label_smoothing"], theirs["disable_dropout"])


@pytest.mark.slow  # imports TRL and builds its trainer
@pytest.mark.parametrize("case", list(CASES))
def test_first_batch_loss_gradients_and_metrics_equal_trl_cpo_trainer(case, tmp_path):
    pytest.importorskip("trl")
    cfg = SimPOConfig(**CASES[case])
    task = SimPOTask(cfg)
    ours, trainer, mine, ref, logged = first_batch_with_trl(task, cpo_trainer(cfg, tmp_path))
    assert float(mine.detach()) == pytest.approx(float(ref.detach()), abs=1e-5, rel=1e-5)
    assert assert_same_peer_grads(ours, trainer.model) == 2 * 3 * 2   # A and B of q, v, down in 2 layers
    step = task.step_metrics()
    for key, theirs in (("reward_chosen", "rewards/chosen"), ("reward_rejected", "rewards/rejected"),
                        ("reward_margin", "rewards/margins"), ("reward_accuracy", "rewards/accuracies"),
                        ("logps_chosen", "logps/chosen"), ("logps_rejected", "logps/rejected")):
        assert step[key] == pytest.approx(logged[theirs], abs=1e-5), key
    assert step.get("nll_loss", 0.0) == pytest.approx(logged["nll_loss"], abs=1e-5)
    assert (cfg.cpo_alpha == 0) == ("nll_loss" not in step)


def test_simpo_is_eq_6_on_the_per_token_log_probs():
    """``-log sigma(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma)`` from sums and lengths."""
    sums, lengths = torch.tensor([[-6.0, -12.0], [-3.0, -2.0]]), torch.tensor([[3.0, 4.0], [1.0, 2.0]])
    losses, rewards = simpo_losses(sums / lengths, "simpo", beta=2.0, gamma=0.5)
    expect = -F.logsigmoid(2.0 / lengths[:, 0] * sums[:, 0] - 2.0 / lengths[:, 1] * sums[:, 1] - 0.5)
    assert torch.allclose(losses, expect, atol=1e-7)                     # pair 0: -log sigma(1.5)
    assert float(losses[0]) == pytest.approx(-float(F.logsigmoid(torch.tensor(1.5))), abs=1e-7)
    assert torch.allclose(rewards, 2.0 * sums / lengths)


def raw_config(source, **task) -> dict:
    return {"model": {"path": "tiny-llama"}, "task": {"name": "simpo", **task},
            "data": {"source": str(source), "max_length": 32, "eval_fraction": 0.25},
            "method": {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"]},
            "train": {"steps": 1, "batch_size": 4, "progress": False}}


@pytest.mark.parametrize("case", ["no-columns", "values", "eval-samples"])
def test_bad_input_is_one_line(case, tmp_path):
    recs = [{"prompt": f"def f{i}(x):\n", "chosen": f"    return {i}", "rejected": "    pass"} for i in range(8)]
    if case == "no-columns":                                # SFT records given to a pair task
        recs = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in recs]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    task = {"gamma": -0.5, "beta": 0.0, "cpo_alpha": -1.0, "loss": "hinge", "label_smoothing": 0.1} \
        if case == "values" else {}
    raw = raw_config(path, **task)
    if case == "eval-samples":
        raw["eval"] = {"samples": 2}
    res = invoke("train", write_yaml(tmp_path / "c.yaml", raw), "--out", tmp_path / "run")
    needles = {"no-columns": ("no 'chosen' field", "data.chosen_field"),
               "values": ("task.beta: got 0.0; expected a value > 0", "task.gamma: got -0.5; expected a margin >= 0",
                          "task.cpo_alpha: got -1.0", "task.label_smoothing: applies to loss simpo or sigmoid only"),
               "eval-samples": ("eval.samples is not supported with task.name: simpo",)}[case]
    assert_user_error(res, *needles)
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_section_defaults_are_recorded():
    from rankwise.recipes.config import load_run_config
    cfg = load_run_config(None, base={"model": {"path": "tiny-llama"}, "task": {"name": "simpo"}})
    assert cfg.to_dict()["task"] == {"name": "simpo", "loss": "simpo", "beta": 0.1, "gamma": 0.5,
                                     "cpo_alpha": 1.0, "label_smoothing": 0.0, "disable_dropout": True}
