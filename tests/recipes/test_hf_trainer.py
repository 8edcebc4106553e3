"""rankwise inside the HF ecosystem: ``transformers.Trainer`` trains a model adapted by
``rankwise.apply`` (GoRA, calibrated on batches) with ``rankwise.optimizer`` (GaLore), saves, and
the saved adapter exports to a PEFT folder that PEFT itself loads with the same outputs."""
from __future__ import annotations

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
