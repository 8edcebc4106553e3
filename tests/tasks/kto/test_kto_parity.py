"""The ``kto`` task's loss against TRL 1.16's ``KTOTrainer`` on a PEFT LoRA of the same tiny model:
same weights, same token batch (desirable and undesirable rows, TRL's mismatched KL rows), the
first batch's loss and every LoRA gradient to 1e-5 (fp32); the KL reference point and the loss
against their formulas; the cross-process average of the KL estimate; evaluation independent of
its batch size."""
from __future__ import annotations

import copy

import pytest
import torch

from rankwise import registry
from rankwise.adapters.lora.config import LoraConfig as RwLoraConfig
from rankwise.core.ops import disable_adapters
from rankwise.core.protocol import adapter_modules, factors
from rankwise.tasks.kto.task import KTOConfig, KTOTask, kl_reference_point, kto_losses
from rankwise.testing import VOCAB, same_factors, tiny_llama_lm

TARGETS = ["q_proj", "v_proj", "down_proj"]
LABELS = [True, False, True, True, False, False]


def examples(seed: int = 3, labels: list[bool] = LABELS) -> list[dict]:
    """Random token examples: prompts of 2-5 tokens, completions of 1-6 (padded in a batch)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for label in labels:
        prompt, completion = (torch.randint(1, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),),
                                            generator=g).tolist() for lo, hi in ((2, 6), (1, 7)))
        out.append({"prompt_ids": prompt, "completion_ids": completion, "label": label, "keep": 0,
                    "max_length": 64})
    return out


def lora_model(seed: int = 11):
    """A rankwise LoRA on tiny-llama with non-zero A and B (the adapters move the policy)."""
    model = tiny_llama_lm(seed=0)
    registry.get("method", "lora").apply(model, RwLoraConfig(r=4, alpha=8.0, targets=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, mod in adapter_modules(model):
            for w in factors(mod, "default"):
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    return model.train()


def trl_trainer(model, config: KTOConfig, tmp_path):
    """TRL's KTOTrainer over a PEFT LoRA of ``model`` (given the base and a ``peft_config``: the
    reference is the adapters switched off, not a copied ``ref`` adapter)."""
    trl, peft = pytest.importorskip("trl"), pytest.importorskip("peft")
    from datasets import Dataset
    from tokenizers import Tokenizer, models as tmodels
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tmodels.WordLevel(
        {f"t{i}": i for i in range(VOCAB)}, unk_token="t1")), pad_token="t0", eos_token="t0")
    data = Dataset.from_dict({"prompt": ["t2 t3", "t4"], "completion": [" t4", " t5"], "label": [True, False]})
    args = trl.KTOConfig(output_dir=str(tmp_path), beta=config.beta, desirable_weight=config.desirable_weight,
                         undesirable_weight=config.undesirable_weight, report_to=[], use_cpu=True,
                         per_device_train_batch_size=len(LABELS), bf16=False, fp16=False,
                         gradient_checkpointing=False)
    return trl.KTOTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                          peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))


@pytest.mark.slow  # imports TRL and builds its trainer (~20 s once under load)
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.3, 0.7)])
def test_first_batch_loss_and_every_lora_gradient_equal_trl_kto_trainer(weights, tmp_path):
    config = KTOConfig(beta=0.5, desirable_weight=weights[0], undesirable_weight=weights[1],
                       reference="adapters-off")
    ours = lora_model()
    trainer = trl_trainer(copy.deepcopy(tiny_llama_lm(seed=0)), config, tmp_path)
    assert "ref" not in trainer.model.peft_config
    same_factors(ours, trainer.model)
    task = KTOTask(config)
    batch = task.collate(examples(), pad_id=0)
    total, out = task.loss_sum(ours, batch)
    mine = total / task.count_targets(batch)
    mine.backward()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "completion_mask": (batch["labels"] != -100).long(), "KL_input_ids": batch["kl_input_ids"],
              "KL_attention_mask": batch["kl_attention_mask"],
              "KL_completion_mask": (batch["kl_labels"] != -100).long(), "label": batch["desirable"]}
    theirs = trainer._compute_loss(trainer.model.train(), inputs, False)
    theirs.backward()
    assert float(mine.detach()) == pytest.approx(float(theirs.detach()), abs=1e-5)
    logged = trainer._metrics["train"]
    assert out.z == pytest.approx(logged["kl"][-1], abs=1e-5) and out.z > 0.05   # the KL term is in it
    assert float(0.5 * out.ratios[out.desirable].mean()) == pytest.approx(logged["rewards/chosen"][-1], abs=1e-5)
    assert float(0.5 * out.ratios[~out.desirable].mean()) == pytest.approx(logged["rewards/rejected"][-1], abs=1e-5)
    named = dict(trainer.model.named_modules())
    compared = 0
    for path, mod in adapter_modules(ours):
        layer = named["base_model.model." + path]
        for ours_w, peer_w in zip(factors(mod, "default"), (layer.lora_A["default"].weight,
                                                            layer.lora_B["default"].weight)):
            assert ours_w.grad is not None and peer_w.grad is not None
            assert torch.allclose(ours_w.grad, peer_w.grad, atol=1e-5, rtol=0), (path, ours_w.shape)
            compared += 1
    assert compared == 2 * 2 * len(TARGETS)   # 2 layers x 3 targets x (A, B)


def test_kl_rows_rotate_the_completions_and_the_reference_point_is_their_clamped_mean():
    """Row ``i`` of the mismatched batch is prompt ``i`` + completion ``i - 1`` (cyclic); ``z``
    is the mean over those rows of log pi - log pi_ref (by hand, log-softmax over the whole
    vocabulary, adapters off for the reference), clamped at 0, and has no gradient."""
    model, items = lora_model(), examples()
    task = KTOTask(KTOConfig(beta=0.5, reference="adapters-off"))
    batch = task.collate(items, pad_id=0)
    ratios = []
    for i, it in enumerate(items):
        other = items[i - 1]["completion_ids"]
        ids = torch.tensor([it["prompt_ids"] + other])
        row = batch["kl_input_ids"][i][batch["kl_attention_mask"][i].bool()]
        assert row.tolist() == ids[0].tolist()
        with torch.no_grad():
            pol = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
            with disable_adapters(model):
                ref = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
        k = len(it["prompt_ids"])
        tgt = ids[0, k:]
        ratios.append(float((pol[k - 1:].gather(-1, tgt[:, None]) - ref[k - 1:].gather(-1, tgt[:, None])).sum()))
    total, out = task.loss_sum(model, batch)
    expect = max(0.0, sum(ratios) / len(ratios))
    assert out.z == pytest.approx(expect, abs=1e-5) and expect > 0.05
    assert torch.allclose(out.kl_ratios, torch.tensor(ratios), atol=1e-5)
    assert total.requires_grad and not out.kl_ratios.requires_grad


def test_kto_losses_follow_eq_8_and_the_clamp():
    policy = torch.tensor([-3.0, -5.0, -7.0, -2.0])
    ref = torch.tensor([-4.0, -4.5, -6.0, -2.5])
    desirable = torch.tensor([True, False, True, False])
    z = kl_reference_point(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.1]))   # mean 0.3
    assert float(z) == pytest.approx(0.3, abs=1e-7)
    assert float(kl_reference_point(torch.tensor([-2.0]), torch.tensor([-1.0]))) == 0.0   # clamped
    losses, rewards = kto_losses(policy, ref, z, desirable, 0.2, 1.5, 0.5)
    r = policy - ref                                                       # 1, -0.5, -1, 0.5
    sig = torch.sigmoid
    expect = torch.stack([1.5 * (1 - sig(0.2 * (r[0] - 0.3))), 0.5 * (1 - sig(0.2 * (0.3 - r[1]))),
                          1.5 * (1 - sig(0.2 * (r[2] - 0.3))), 0.5 * (1 - sig(0.2 * (0.3 - r[3])))])
    assert torch.allclose(losses, expect, atol=1e-7) and torch.allclose(rewards, 0.2 * r)


def test_the_kl_estimate_is_averaged_over_processes_before_the_clamp(monkeypatch):
    """Under torchrun TRL gathers each process's mean and averages (then clamps): this process's
    mean -0.2 and another's 0.6 give z = 0.2, where this process alone would clamp to 0."""
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda t: t.add_(0.6))          # the other process's mean
    mine, ref = torch.tensor([-1.0, -1.2]), torch.tensor([-0.9, -0.9])      # mean -0.2
    assert float(kl_reference_point(mine, ref, across=True)) == pytest.approx(0.2, abs=1e-6)
    assert float(kl_reference_point(mine, ref, across=False)) == 0.0


def test_evaluation_uses_fixed_partners_and_one_reference_point_whatever_the_batch():
    """The evaluation's metrics with batches of 1, of 4 and sliced under a small logits budget
    equal those of one batch; eval_loss is eq. 8 with z over the whole set."""
    from rankwise.engine import evaluate
    from rankwise.tasks.kto.data import UnpairedData
    model = lora_model()
    items = examples(seed=11, labels=[True, False, False] * 3)
    data = UnpairedData([{k: e[k] for k in ("prompt_ids", "completion_ids", "label")} for e in items], 0, 0, 64)
    data.fix_partners()
    assert all(e["kl_completion_ids"] is not e["completion_ids"] for e in data.examples)
    task = KTOTask(KTOConfig(beta=0.5, reference="adapters-off"))
    whole = evaluate(model, task, data, batch_size=len(data))
    sliced = KTOTask(task.config)
    sliced.eval_logits_bytes = 2 * 12 * VOCAB * 4
    for other in (evaluate(model, task, data, batch_size=1), evaluate(model, task, data, batch_size=4),
                  evaluate(model, sliced, data, batch_size=len(data))):
        assert other.keys() == whole.keys()
        for key in whole:
            assert other[key] == pytest.approx(whole[key], abs=1e-6), key
    batch = task.collate([data[i] for i in range(len(data))], 0)
    with torch.no_grad():
        _, out = task.loss_sum(model.eval(), batch)
    z = max(0.0, float(out.kl_ratios.mean()))
    losses, _ = kto_losses(out.ratios, torch.zeros_like(out.ratios), torch.tensor(z), out.desirable, 0.5)
    assert whole["eval_kl"] == pytest.approx(z, abs=1e-6)
    assert whole["eval_loss"] == pytest.approx(float(losses.mean()), abs=1e-6)
    assert {"eval_reward_desirable", "eval_reward_undesirable", "eval_reward_margin"} <= set(whole)


def test_chunked_log_probs_give_the_unchunked_loss_kl_precomputed_reference_and_gradients(monkeypatch):
    """``loss_chunk_tokens = 3`` (completions of 1-6 tokens: chunks cross rows): the policy's,
    the mismatched rows' and the adapters-off reference's log-probs all take the chunked path
    (4 calls a loss), and the loss, ``z``, the log-ratios, the precomputed reference and every
    LoRA gradient equal the unchunked path to 1e-5 (fp32)."""
    from rankwise.tasks import logprobs
    from rankwise.tasks.kto.data import UnpairedData
    from rankwise.tasks.kto.task import precompute_reference
    from tests.tasks.pair_fixtures import assert_same_grads, grads
    calls = []
    real = logprobs.chunked_logps
    monkeypatch.setattr(logprobs, "chunked_logps", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    base, items = lora_model(), examples()
    batch = KTOTask().collate(items, pad_id=0)
    data = UnpairedData([{k: e[k] for k in ("prompt_ids", "completion_ids", "label")} for e in items], 0, 0, 64)
    data.fix_partners()
    runs = {}
    for chunk in (0, 3):
        model = copy.deepcopy(base)
        task = KTOTask(KTOConfig(beta=0.5, desirable_weight=1.3, undesirable_weight=0.7, reference="adapters-off"))
        task.loss_chunk_tokens = chunk
        total, out = task.loss_sum(model, batch)
        total.backward()
        assert len(calls) == (4 if chunk else 0)
        stored = torch.tensor(precompute_reference(task, model, data, 4, "cpu"))
        runs[chunk] = float(total.detach()), out, grads(model), stored
    (total, out, got, stored), (ref_total, ref_out, ref_grads, ref_stored) = runs[3], runs[0]
    assert set(calls) == {3}
    assert total == pytest.approx(ref_total, abs=1e-5, rel=1e-5)
    assert out.z == pytest.approx(ref_out.z, abs=1e-5) and ref_out.z > 0.05      # the KL term is in it
    for name in ("logps", "ratios", "kl_ratios"):
        torch.testing.assert_close(getattr(out, name), getattr(ref_out, name), rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(stored, ref_stored, rtol=1e-5, atol=1e-5)
    assert float(ref_out.ratios.abs().min()) > 1e-3                                # policy != reference
    assert_same_grads(got, ref_grads)
    assert len(ref_grads) == 2 * 2 * len(TARGETS)
