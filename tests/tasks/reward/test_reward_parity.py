"""The ``reward`` task's loss against TRL 1.16's ``RewardTrainer`` on a PEFT LoRA (+ the ``score``
head in ``modules_to_save``) of the same tiny Llama reward model: same factors, same head, same
token batch; the first batch's loss and every LoRA and head gradient within 1e-5 (fp32), without
and with a per-pair margin and with the centring term. The formula and the pooling (the last
token that is not padding) against hand computations."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from rankwise import registry
from rankwise.adapters.lora.config import LoraConfig as RwLoraConfig
from rankwise.core.protocol import adapter_modules, factors
from rankwise.errors import RankwiseError
from rankwise.tasks.reward.task import RewardConfig, RewardTask, reward_losses
from rankwise.testing import VOCAB, same_factors
from tests.tasks.pair_fixtures import TARGETS, pairs, tokenizer


def tiny_reward_model(seed: int = 0, num_labels: int = 1):
    """A 2-layer, 16-wide ``LlamaForSequenceClassification`` (pad id 0)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, num_labels=num_labels)
    return LlamaForSequenceClassification(cfg).eval()


def models(tmp_path, center: float | None):
    """(rankwise LoRA reward model, TRL RewardTrainer over a PEFT LoRA) of one base, with equal,
    non-zero factors and an equal, larger head (so both matter)."""
    peft = pytest.importorskip("peft")
    base = tiny_reward_model()
    ours = copy.deepcopy(base)
    registry.get("method", "lora").apply(ours, RwLoraConfig(r=4, alpha=8.0, targets=TARGETS))
    assert ours.score.weight.requires_grad  # the head trains beside the adapter
    trainer = trl_trainer(copy.deepcopy(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, modules_to_save=["score"],
        task_type="SEQ_CLS"), center, tmp_path)
    g = torch.Generator().manual_seed(5)
    head = torch.randn(ours.score.weight.shape, generator=g) * 2.0
    with torch.no_grad():
        for _, mod in adapter_modules(ours):
            for w in factors(mod, "default"):
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
        ours.score.weight.copy_(head)
        peer_head(trainer.model).weight.copy_(head)
    same_factors(ours, trainer.model)
    return ours.train(), trainer


def peer_head(peft_model):
    """The trained copy of ``score`` in PEFT's ``modules_to_save`` wrapper."""
    return peft_model.base_model.model.score.modules_to_save["default"]


def trl_trainer(model, peft_config, center: float | None, tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    tok = tokenizer()
    data = Dataset.from_dict({"chosen_ids": [[2, 3, 4]], "rejected_ids": [[2, 3, 5]]})
    args = trl.RewardConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, fp16=False,
                            per_device_train_batch_size=4, gradient_checkpointing=False,
                            center_rewards_coefficient=center)
    return trl.RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                             peft_config=peft_config)


def lora_grads(ours, peer) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, our gradient, TRL's)`` of every LoRA factor and of the head."""
    named = dict(peer.named_modules())
    out = []
    for path, mod in adapter_modules(ours):
        a, b = factors(mod, "default")
        layer = named["base_model.model." + path]
        out += [(f"{path}.A", a.grad, layer.lora_A["default"].weight.grad),
                (f"{path}.B", b.grad, layer.lora_B["default"].weight.grad)]
    return out + [("score", ours.score.weight.grad, peer_head(peer).weight.grad)]


@pytest.mark.slow  # imports TRL and builds its trainer (~20 s once under load)
@pytest.mark.parametrize("margin, center", [(False, None), (True, None), (True, 0.5)])
def test_first_batch_loss_and_every_gradient_equal_trl_reward_trainer(margin, center, tmp_path):
    ours, trainer = models(tmp_path, center)
    task = RewardTask(RewardConfig(center_rewards_coefficient=center or 0.0))
    batch = task.collate(pairs(margins=margin), pad_id=0)
    assert ("margin" in batch) == margin
    total, out = task.loss_sum(ours, batch)
    mine = total / task.count_targets(batch)
    mine.backward()
    inputs = {k: v.clone() for k, v in batch.items()}
    theirs = trainer.compute_loss(trainer.model, inputs)
    theirs.backward()
    assert float(mine.detach()) == pytest.approx(float(theirs.detach()), abs=1e-5, rel=1e-5)
    plain = float(F.softplus(-(out.rewards[:, 0] - out.rewards[:, 1])).mean())
    if margin or center:  # the margin / centring term changed the loss
        assert abs(float(mine) - plain) > 1e-3
    grads = lora_grads(ours, trainer.model)
    assert len(grads) == 2 * 2 * len(TARGETS) + 1
    for name, g_ours, g_trl in grads:
        assert g_ours is not None and g_trl is not None, name
        assert float(g_trl.abs().max()) > 0, name
        assert torch.allclose(g_ours, g_trl, atol=1e-5, rtol=1e-5), (name, float((g_ours - g_trl).abs().max()))
    logged = trainer._metrics["train"]
    assert float((out.rewards[:, 0] > out.rewards[:, 1]).float().mean()) == pytest.approx(logged["accuracy"][-1])
    assert float((out.rewards[:, 0] - out.rewards[:, 1]).mean()) == pytest.approx(logged["margin"][-1], abs=1e-5)


def test_losses_are_bradley_terry_with_llama2_margin_and_centring():
    chosen, rejected = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.5])
    margin = torch.tensor([0.5, 0.0, 1.0])
    want = [-torch.log(torch.sigmoid(c - r - m)) + 0.1 * (c + r) ** 2
            for c, r, m in zip(chosen, rejected, margin)]
    got = reward_losses(chosen, rejected, margin, center=0.1)
    assert torch.allclose(got, torch.stack(want), atol=1e-6)
    assert torch.allclose(reward_losses(chosen, rejected), -F.logsigmoid(chosen - rejected), atol=1e-7)


def test_reward_is_the_head_at_the_last_token_that_is_not_padding():
    model = tiny_reward_model()
    task = RewardTask()
    items = pairs(n=3)
    batch = task.collate(items, pad_id=0)
    with torch.no_grad():
        rewards, _ = task.pair_rewards(model, batch)
        for i, it in enumerate(items):
            for side, col in (("chosen", 0), ("rejected", 1)):
                ids = torch.tensor([it[f"{side}_ids"]])
                hidden = model.model(input_ids=ids).last_hidden_state[0, -1]
                assert float(rewards[i, col]) == pytest.approx(float(model.score(hidden)), abs=1e-5)


def test_a_head_with_more_than_one_output_is_refused():
    task = RewardTask()
    batch = task.collate(pairs(n=2), pad_id=0)
    with pytest.raises(RankwiseError, match=r"num_labels=1\); this head has 3"):
        task.pair_rewards(tiny_reward_model(num_labels=3), batch)
