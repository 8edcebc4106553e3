"""Decoder classifiers (GPT-2, Llama) with virtual tokens read the logits of the last real
token, as the un-prompted model does, not of the padding at the end of the batch."""
from __future__ import annotations

import pytest
import torch

from rankwise.core.protocol import transform_inputs
from rankwise.testing import tiny_batch


def _decoder_classifier(kind: str):
    from transformers import (GPT2Config, GPT2ForSequenceClassification, LlamaConfig,
                              LlamaForSequenceClassification)
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, num_labels=3,
                         pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2ForSequenceClassification(cfg).eval()
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      num_labels=3, pad_token_id=0)
    return LlamaForSequenceClassification(cfg).eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_decoder_classifier_with_virtual_tokens_reads_the_last_real_token(kind):
    from rankwise.adapters.prompt import PromptTuningConfig, apply_prompt_tuning

    model = _decoder_classifier(kind)
    apply_prompt_tuning(model, PromptTuningConfig(num_virtual_tokens=2))
    batch = tiny_batch("bert", seed=3)                     # ids 1..63, class labels
    batch["input_ids"][0, 5:] = 0                          # example 0: 5 tokens + 3 pads (id 0)
    batch["attention_mask"][0, 5:] = 0
    per_position = {}
    model.score.register_forward_hook(lambda m, a, o: per_position.__setitem__("all", o))
    with torch.no_grad():
        out = model(**{k: v for k, v in transform_inputs(model, batch).items() if k != "labels"})
    # the un-prompted path's rule: the rightmost id that is not the pad id, shifted by v = 2
    last = (torch.arange(8) * (batch["input_ids"] != 0)).argmax(-1)
    assert last.tolist() == [4, 7]
    want = per_position["all"][torch.arange(2), 2 + last]
    assert torch.equal(out.logits, want)
    assert not torch.allclose(out.logits[0], per_position["all"][0, -1])   # the pad it read before
    # so the example's logits do not depend on how much padding its batch had
    alone = {"input_ids": batch["input_ids"][:1, :5], "attention_mask": batch["attention_mask"][:1, :5]}
    with torch.no_grad():
        single = model(**transform_inputs(model, alone)).logits
    torch.testing.assert_close(out.logits[:1], single, atol=1e-6, rtol=0)
