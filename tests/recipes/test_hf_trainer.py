"""rankwise inside the HF ecosystem: ``transformers.Trainer`` trains a model adapted by
``rankwise.apply`` (GoRA, calibrated on batches) with ``rankwise.optimizer`` (GaLore), saves, and
the saved adapter exports to a PEFT folder that PEFT itself loads with the same outputs; and every
registered method trains under a plain ``Trainer`` on the engine's task loss."""
from __future__ import annotations

import math

import pytest
import torch

import rankwise
from rankwise.data.text import build_data
from rankwise.engine import get_task
from rankwise.recipes.config import DataConfig
from rankwise.recipes.model import load_model

LM = get_task("causal-lm")


class Examples(torch.utils.data.Dataset):
    """rankwise examples as a map-style torch dataset (the Trainer shuffles indices)."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


@pytest.mark.slow
def test_trainer_trains_saves_and_exports_to_peft(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model, tok = load_model("tiny-llama", LM, seed=0)
    cfg = DataConfig(source="stdlib-functions", format="prompt-completion", max_length=48, limit=64,
                     cache_dir=str(tmp_path / "cache"))
    train, _ = build_data(cfg, LM, tok)
    collate = lambda items: LM.collate(items, tok.pad_token_id)                      # noqa: E731
    calib = [collate([train[i] for i in range(k, k + 4)]) for k in (0, 4)]
    method = rankwise.apply(model, "gora", batches=calib, r=4, targets=["q_proj", "v_proj"])
    opt = rankwise.optimizer(model, "galore", lr=1e-2, rank=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=5, per_device_train_batch_size=4, save_steps=5,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, remove_unused_columns=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Examples(train),
                                   data_collator=collate, optimizers=(opt, None))
    result = trainer.train()
    assert result.global_step == 5 and (tmp_path / "hf" / "checkpoint-5").is_dir()
    assert type(opt).__module__.startswith("rankwise.optim") and any(opt.state.values())  # GaLore stepped
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert len(moved) == len(before)                                               # every adapter tensor trained
    trainer.save_model(str(tmp_path / "hf" / "final"))
    rankwise.save_adapter(model, tmp_path / "adapter", method)

    fresh, _ = load_model("tiny-llama", LM, seed=0)
    rankwise.load_adapter(fresh, tmp_path / "adapter")
    rankwise.export_peft(fresh, tmp_path / "peft")
    base, _ = load_model("tiny-llama", LM, seed=0)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    batch = collate([train[i] for i in range(4)])
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    model.eval()
    with torch.no_grad():
        want = model(**inputs).logits
        assert torch.allclose(loaded(**inputs).logits, want, atol=1e-5)
        plain = load_model("tiny-llama", LM, seed=0)[0].eval()
        assert not torch.allclose(plain(**inputs).logits, want, atol=1e-4)           # the adapter matters


# Small settings on the tiny Llama (those of tests/test_contract.py); PT-MoE without router noise
# and top_k = num_experts, so its loss is deterministic and every expert is reached.
SETTINGS = {
    "lora": {"r": 2}, "gora": {"r": 2, "r_min": 1, "r_max": 4, "n_batches": 2},
    "moe-lora": {"num_experts": 3, "top_k": 2, "r": 2}, "lope": {"r": 2, "num_experts": 2},
    "smore": {"experts": [3, 2], "ranks": [2, 2], "fanout": [2, 1], "gate_dims": [4, 4], "down_dim": 4},
    "fvae-lora": {"r": 2, "enc_hidden": 8, "dec_hidden": 8}, "lota-qaf": {"r": 2}, "lowrank": {"rank": 2},
    "prompt-tuning": {"num_virtual_tokens": 3},
    "pt-moe": {"num_virtual_tokens": 3, "num_experts": 2, "rank": 2, "top_k": 2, "noise_std": 0.0},
}
CANNOT_RUN = {  # method -> why the Trainer cannot train it on a causal LM
    "frozen": "frozen trains only a classification head; a causal LM has none, so nothing trains",
}


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    _, tok = load_model("tiny-llama", LM, seed=0)
    cfg = DataConfig(source="stdlib-functions", format="prompt-completion", max_length=48, limit=16,
                     cache_dir=str(tmp_path_factory.mktemp("cache")))
    train, _ = build_data(cfg, LM, tok)
    return [train[i] for i in range(4)], tok.pad_token_id


@pytest.mark.slow
@pytest.mark.parametrize("name", rankwise.registry.names("method"))
def test_trainer_trains_every_method_on_the_engine_objective(name, examples, tmp_path):
    """What ``Trainer`` optimises (``model(**batch).loss``) is the engine's task loss to 1e-6 (for
    prompt methods: the virtual tokens are in the model's own forward), and three Trainer steps
    move every trainable tensor that loss reaches. Auxiliary losses (router balance, FVAE's ELBO
    terms) are the engine's addition; a plain Trainer does not add them."""
    if name in CANNOT_RUN:
        pytest.skip(CANNOT_RUN[name])
    transformers = pytest.importorskip("transformers")
    items, pad_id = examples
    batch = LM.collate(items, pad_id)
    model, _ = load_model("tiny-llama", LM, seed=0)
    calib = {"batches": [batch, batch]} if rankwise.registry.get("method", name).needs_batches else {}
    rankwise.apply(model, name, **calib, **SETTINGS.get(name, {}))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=3, per_device_train_batch_size=4, save_strategy="no",
        logging_steps=1, report_to=[], use_cpu=True, seed=0, remove_unused_columns=False, learning_rate=1e-2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Examples(items),
                                   data_collator=lambda it: LM.collate(it, pad_id))
    model.eval()                                                   # deterministic (FVAE samples in training)
    with torch.no_grad():
        theirs, ours = trainer.compute_loss(model, batch), LM.mean_loss(model, batch)
    assert abs(theirs.item() - ours.item()) < 1e-6, (theirs.item(), ours.item())
    model.train()
    trainer.compute_loss(model, batch).backward()
    reached = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    model.zero_grad(set_to_none=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert reached and reached <= set(before)
    result = trainer.train()
    assert result.global_step == 3 and all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    moved = {n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    assert reached <= moved, sorted(reached - moved)
