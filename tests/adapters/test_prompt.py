"""Prompt tuning through the input-adapter seam: only the virtual tokens train, HF PEFT loads
the PROMPT_TUNING export with the same logits and generation, and the causal-LM label shift
lines up (logits/labels alignment in numbers)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from rankwise.adapters.prompt import PromptLayer, PromptTuningConfig, apply_prompt_tuning
from rankwise.adapters.prompt.peft import export_prompt_peft
from rankwise.core.protocol import transform_inputs
from rankwise.engine import get_task
from rankwise.engine.generation import generate
from rankwise.engine.task import IGNORE
from rankwise.errors import RankwiseError
from rankwise.testing import tiny_batch, tiny_bert_cls, tiny_gpt2_lm, tiny_llama_lm

peft = pytest.importorskip("peft")


def padded(kind):
    batch = tiny_batch(kind, batch=2, seed=5)
    batch["attention_mask"][1, -3:] = 0
    if kind != "bert":
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
    return batch


def test_only_the_virtual_tokens_train_and_start_from_vocabulary_rows():
    model = tiny_llama_lm()
    apply_prompt_tuning(model, PromptTuningConfig(num_virtual_tokens=4))
    layer = model.model.embed_tokens
    assert isinstance(layer, PromptLayer) and model.get_input_embeddings() is layer
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["model.embed_tokens.prompts.default.prompt_embeddings"]
    prompt = layer.prompts["default"].prompt_embeddings.detach()
    assert prompt.shape == (4, 16)
    is_row = (prompt[:, None, :] == layer.weight.detach()[None]).all(-1)   # (4, vocab)
    assert is_row.any(-1).all()                                        # each row is a vocabulary row
    batch = {k: v for k, v in tiny_batch("llama").items() if k != "labels"}
    assert torch.equal(layer(batch["input_ids"]), layer.base_layer(batch["input_ids"]))  # lookup unchanged


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_peft_loads_the_export_with_the_same_logits(kind, tmp_path):
    build = tiny_gpt2_lm if kind == "gpt2" else tiny_bert_cls
    model = build()
    apply_prompt_tuning(model, PromptTuningConfig(num_virtual_tokens=3, init="random"))
    with torch.no_grad():                                            # trained-looking prompt and head
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
    export_prompt_peft(model, tmp_path / "peft")
    theirs = peft.PeftModel.from_pretrained(build(), str(tmp_path / "peft")).eval()
    batch = {k: v for k, v in padded(kind).items() if k != "labels"}
    with torch.no_grad():
        ours = model(**transform_inputs(model, batch)).logits
        ref = theirs(**batch).logits
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("build", [tiny_gpt2_lm, tiny_llama_lm])
def test_cached_generation_matches_peft_forward(build, tmp_path):
    """rankwise generate (transformers' KV-cached loop over our prefixed embeddings) equals greedy
    decoding by re-running PEFT's model on the whole sequence at every step. (PEFT 0.21's own
    ``generate`` drops position ids for GPT-2 prompt tuning and diverges from its forward.)"""
    model = build()
    apply_prompt_tuning(model, PromptTuningConfig(num_virtual_tokens=3))
    export_prompt_peft(model, tmp_path / "peft")
    theirs = peft.PeftModel.from_pretrained(build(), str(tmp_path / "peft")).eval()
    prompt = [5, 9, 12, 3]
    ours = generate(model, prompt, max_new_tokens=6, eos_id=64, pad_id=0)  # 64: never generated
    ref: list[int] = []
    with torch.no_grad():
        for _ in range(6):
            ids = torch.tensor([prompt + ref])
            ref.append(int(theirs(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].argmax()))
    assert ours == ref


def test_causal_label_shift_lines_up():
    model = tiny_gpt2_lm()
    apply_prompt_tuning(model, PromptTuningConfig(num_virtual_tokens=3))
    task = get_task("causal-lm")
    batch = padded("gpt2")
    loss_sum, _ = task.loss_sum(model, batch)
    with torch.no_grad():
        logits = model(**{k: v for k, v in transform_inputs(model, batch).items() if k != "labels"}).logits
    assert logits.shape[1] == 3 + 8
    # logits at position 3 + i - 1 predict real token i (i >= 1); the prompt predicts nothing
    manual = F.cross_entropy(logits[:, 3:-1].reshape(-1, 64), batch["labels"][:, 1:].reshape(-1),
                             ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(loss_sum.detach(), manual, atol=1e-5, rtol=0)
    shifted = transform_inputs(model, batch)["labels"]
    assert task.count_targets(batch) == int((shifted[:, 1:] != IGNORE).sum()) == 8 + 5 - 2


def test_bad_inputs_are_one_line():
    with pytest.raises(RankwiseError, match="leave no room in the model's 32 positions"):
        apply_prompt_tuning(tiny_gpt2_lm(), PromptTuningConfig(num_virtual_tokens=32))
    model = tiny_gpt2_lm()
    apply_prompt_tuning(model, PromptTuningConfig(num_virtual_tokens=30))
    with pytest.raises(RankwiseError, match="30 virtual tokens \\+ 8 tokens exceed the model's 32 positions"):
        transform_inputs(model, tiny_batch("gpt2"))
    packed = {**tiny_batch("gpt2"), "position_ids": torch.arange(8).expand(2, 8)}
    with pytest.raises(RankwiseError, match="data.packing: false"):
        transform_inputs(model, packed)

    class NoEmbeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(RankwiseError, match="needs a model with input token embeddings"):
        apply_prompt_tuning(NoEmbeddings(), PromptTuningConfig())
