"""The ``dpo`` task's loss against TRL's ``DPOTrainer`` on a PEFT LoRA of the same tiny model:
same weights, same token batch, the first batch's loss to 1e-5 (fp32) for sigmoid, ipo and
hinge; and the conservative (label-smoothed) DPO loss against its formula."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from rankwise import registry
from rankwise.adapters.lora.config import LoraConfig as RwLoraConfig
from rankwise.tasks.dpo.task import DPOConfig, DPOTask, completion_logps, dpo_losses
from rankwise.testing import VOCAB
from tests.tasks.pair_fixtures import lora_and_trainer, lora_model, pairs


def models(tmp_path, loss: str, beta: float):
    """(rankwise LoRA model, TRL ``DPOTrainer`` over a PEFT LoRA) of one base with equal,
    non-zero adapters (:func:`tests.tasks.pair_fixtures.lora_and_trainer`)."""
    ours, trainer = lora_and_trainer(lambda base, peft_config, data, tok: trl_trainer(
        base, peft_config, data, tok, loss, beta, tmp_path))
    assert "ref" not in trainer.model.peft_config  # the reference is the adapters switched off
    return ours, trainer


def trl_trainer(model, peft_config, data, tok, loss: str, beta: float, tmp_path):
    trl = pytest.importorskip("trl")
    args = trl.DPOConfig(output_dir=str(tmp_path), beta=beta, loss_type=[loss], report_to=[],
                         use_cpu=True, per_device_train_batch_size=4, bf16=False, fp16=False)
    return trl.DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                          peft_config=peft_config)


@pytest.mark.slow  # imports TRL and builds its trainer (~18 s once under load, 0.2 s after)
@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
def test_first_batch_loss_equals_trl_dpo_trainer(loss, tmp_path):
    beta = 0.5
    ours, trainer = models(tmp_path, loss, beta)
    task = DPOTask(DPOConfig(loss=loss, beta=beta, reference="adapters-off"))
    batch = task.collate(pairs(), pad_id=0)
    total, out = task.loss_sum(ours, batch)
    mine = float(total.detach()) / task.count_targets(batch)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "completion_mask": (batch["labels"] != -100).long()}
    ref = float(trainer._compute_loss(trainer.model, inputs, False))
    assert mine == pytest.approx(ref, abs=1e-5, rel=1e-5)
    at_init = {"sigmoid": math.log(2), "ipo": 1 / (2 * beta) ** 2, "hinge": 1.0}[loss]
    assert abs(mine - at_init) > 1e-3  # the adapters moved the policy off the reference
    rewards = trainer._metrics["train"]
    assert float(out.rewards[:, 0].mean()) == pytest.approx(rewards["rewards/chosen"][-1], abs=1e-5)
    assert float((out.rewards[:, 0] - out.rewards[:, 1]).mean()) == pytest.approx(
        rewards["rewards/margins"][-1], abs=1e-5)


def test_label_smoothing_is_conservative_dpo():
    policy = torch.tensor([[-3.0, -5.0], [-7.0, -2.0]])
    ref = torch.tensor([[-4.0, -4.5], [-6.0, -2.5]])
    h = (policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1])          # 1.5, -1.5
    losses, rewards = dpo_losses(policy, ref, torch.ones(2, 2), "sigmoid", 0.2, 0.1)
    expect = -0.9 * F.logsigmoid(0.2 * h) - 0.1 * F.logsigmoid(-0.2 * h)
    assert torch.allclose(losses, expect, atol=1e-7)
    assert torch.allclose(rewards, 0.2 * (policy - ref))


def test_completion_logps_skip_the_prompt():
    logits = torch.randn(1, 4, 6)
    labels = torch.tensor([[-100, -100, 3, 5]])
    logp = torch.log_softmax(logits, -1)
    total, count = completion_logps(logits, labels)
    assert float(total) == pytest.approx(float(logp[0, 1, 3] + logp[0, 2, 5]), abs=1e-6) and int(count) == 2


def test_evaluation_in_slices_of_whole_pairs_gives_the_same_metrics():
    from rankwise.engine import evaluate
    from rankwise.tasks.pairs import PairData
    model = lora_model()
    data = PairData(pairs(n=5), pad_id=0)
    whole = evaluate(model, DPOTask(), data, batch_size=5)
    sliced_task = DPOTask()
    sliced_task.eval_logits_bytes = 2 * 12 * VOCAB * 4                # two rows (one pair) per forward
    batch = sliced_task.collate([data[i] for i in range(5)], 0)
    assert len(sliced_task.eval_parts(model, batch)) == 5
    sliced = evaluate(model, sliced_task, data, batch_size=5)
    assert whole.keys() == sliced.keys() and whole["eval_reward_margin"] != 0.0
    for key in whole:
        assert sliced[key] == pytest.approx(whole[key], abs=1e-6), key


def long_pairs(seed: int = 11, n: int = 8, width: int = 20) -> list[dict]:
    """``n`` pairs with a 4-token prompt and ``width``-token completions (the review's check)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt, c, r = (torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in (4, width, width))
        out.append({"chosen_ids": prompt + c, "chosen_labels": [-100] * 4 + c,
                    "rejected_ids": prompt + r, "rejected_labels": [-100] * 4 + r})
    return out


@pytest.mark.parametrize("disable", [True, False])
def test_first_loss_of_a_fresh_lora_is_log_2_on_a_model_with_dropout(disable):
    """GPT-2 with dropout 0.1 (its own default) and LoRA dropout 0.1: with ``disable_dropout``
    (TRL's default) the policy and the adapters-off reference are one function and the first
    loss is log 2 to 1e-6; without it they draw different masks (the review measured 0.6884)."""
    from rankwise.testing import tiny_gpt2_lm
    model = tiny_gpt2_lm(seed=0, dropout=0.1)
    registry.get("method", "lora").apply(model, RwLoraConfig(r=4, alpha=8.0, targets=["c_attn", "c_fc"],
                                                             dropout=0.1))
    task = DPOTask(DPOConfig(beta=0.1, reference="adapters-off", disable_dropout=disable))
    assert task.prepare(model, [], False, 8, "cpu") == "adapters-off"
    drops = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(drops) > 10 and all(p == (0.0 if disable else 0.1) for p in drops)
    model.train()
    torch.manual_seed(0)
    batch = task.collate(long_pairs(), pad_id=0)
    total, out = task.loss_sum(model, batch)
    loss = float(total.detach()) / task.count_targets(batch)
    if disable:
        assert loss == pytest.approx(math.log(2), abs=1e-6)
        assert float(out.rewards.abs().max()) < 1e-6
    else:
        assert abs(loss - math.log(2)) > 1e-3                      # the old behaviour
