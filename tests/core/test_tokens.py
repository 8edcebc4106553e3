"""Trainable token rows (``method.trainable_tokens``, :mod:`rankwise.core.tokens`) on tiny models
built in code: Llama with an untied head, GPT-2 with a head tied to its embedding.

Numbers asserted: the base output at init (exactly); only ``k d`` values train (``2 k d``
untied); the forward equals a copy of the model whose rows ``ids`` hold ``W[ids] + Δ`` (1e-6);
merge matches the unmerged output (1e-5) and unmerge restores the table bit for bit; the tied
head stays the embedding's weight after a merge; save/load with LoRA reproduces the logits
(1e-6); HF PEFT loads the PEFT export on a base resized by transformers' own
``resize_token_embeddings`` (random new rows) and gives the same logits (1e-5); rankwise's
own PEFT loader reads ``trainable_token_indices`` back (1e-6).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from rankwise import registry
from rankwise.adapters.lora.peft import export_peft, load_peft
from rankwise.configs import from_dict
from rankwise.core import count_parameters, merge_adapters, merge_and_unload, unmerge_adapters
from rankwise.core.io import load_adapter, save_adapter
from rankwise.core.tokens import TokenHeadRows, TokenRows, add_trainable_tokens
from rankwise.core.ops import mark_trainable
from rankwise.recipes.tokens import resize_for_tokens
from rankwise.testing import VOCAB, randomize_trainable, tiny_gpt2_lm, tiny_llama_lm

NEW = [VOCAB, VOCAB + 1]          # two added tokens
IDS = torch.tensor([[3, VOCAB, 5, VOCAB + 1, 9, 2], [VOCAB + 1, 1, 4, 7, VOCAB, 8]])
BUILD = {"llama": tiny_llama_lm, "gpt2": tiny_gpt2_lm}


def _base(kind):
    model = BUILD[kind]()
    resize_for_tokens(model, VOCAB + 2, NEW)
    return model


def _adapted(kind, lora=True, tokens=(5, *NEW)):
    model = _base(kind)
    if lora:
        entry = registry.get("method", "lora")
        cfg = from_dict(entry.config_cls, {"name": "lora", "r": 2, "targets": "all-linear"}, "method")
        entry.apply(model, cfg, "default")
    else:
        cfg = None
    add_trainable_tokens(model, list(tokens))
    mark_trainable(model)
    return model, cfg


@torch.no_grad()
def _logits(model):
    return model(input_ids=IDS).logits


def test_new_rows_are_the_mean_of_the_old_rows():
    for kind in BUILD:
        model = _base(kind)
        emb = model.get_input_embeddings().weight
        assert emb.shape[0] == VOCAB + 2
        torch.testing.assert_close(emb[NEW], emb[:VOCAB].mean(0).expand(2, -1), atol=1e-7, rtol=0)
        head = model.get_output_embeddings().weight
        assert (head is emb) == (kind == "gpt2")
        torch.testing.assert_close(head[NEW], head[:VOCAB].mean(0).expand(2, -1), atol=1e-7, rtol=0)


@pytest.mark.parametrize("kind", list(BUILD))
def test_only_the_rows_train_and_the_forward_is_the_replaced_table(kind):
    model, _ = _adapted(kind, lora=False)
    base = _logits(_base(kind))
    torch.testing.assert_close(_logits(model), base, atol=0, rtol=0)  # Δ = 0 at init
    d = model.get_input_embeddings().weight.shape[1]
    trainable, _ = count_parameters(model)
    tied = kind == "gpt2"
    assert trainable == 3 * d * (1 if tied else 2)  # k d rows (and the untied head's own k d)
    randomize_trainable(model, std=0.5)
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {n for n, p in model.named_parameters() if p.requires_grad}
    # reference: a plain copy of the base whose rows ids hold W[ids] + Δ
    ref = _base(kind)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, TokenRows) and isinstance(head, TokenHeadRows) and (head.tied is emb) == tied
    with torch.no_grad():
        idx = torch.tensor(emb.token_ids["default"])
        ref.get_input_embeddings().weight[idx] += emb.deltas["default"]
        if not tied:
            ref.get_output_embeddings().weight[idx] += head.deltas["default"]
    torch.testing.assert_close(_logits(model), _logits(ref), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", list(BUILD))
def test_merge_is_exact_and_a_tied_head_stays_tied(kind):
    model, _ = _adapted(kind)
    randomize_trainable(model, std=0.1)
    want = _logits(model)
    table = model.get_input_embeddings().weight.detach().clone()
    merge_adapters(model)
    torch.testing.assert_close(_logits(model), want, atol=1e-5, rtol=0)
    unmerge_adapters(model)
    assert torch.equal(model.get_input_embeddings().weight, table)
    torch.testing.assert_close(_logits(model), want, atol=1e-5, rtol=0)
    plain = merge_and_unload(model)
    assert isinstance(plain.get_input_embeddings(), torch.nn.Embedding)
    assert (plain.get_output_embeddings().weight is plain.get_input_embeddings().weight) == (kind == "gpt2")
    torch.testing.assert_close(_logits(plain), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", list(BUILD))
def test_save_and_load_with_lora(kind, tmp_path):
    model, cfg = _adapted(kind)
    randomize_trainable(model, std=0.3)
    save_adapter(model, tmp_path / "a", cfg)
    meta = json.loads((tmp_path / "a" / "rankwise_adapter.json").read_text())
    kinds = {p: s.get("role") for p, s in meta["structure"].items() if s.get("kind") == "trainable-tokens"}
    assert sorted(kinds.values()) == ["embedding", "head"]
    fresh = _base(kind)
    load_adapter(fresh, tmp_path / "a")
    torch.testing.assert_close(_logits(fresh), _logits(model), atol=1e-6, rtol=0)
    assert count_parameters(fresh)[0] == count_parameters(model)[0]


@pytest.mark.parametrize("kind", list(BUILD))
def test_peft_loads_the_export_on_a_base_resized_by_transformers(kind, tmp_path):
    peft = pytest.importorskip("peft")
    model, _ = _adapted(kind, tokens=NEW)     # every new token trains: any init of their rows works
    randomize_trainable(model, std=0.3)
    model.eval()
    export_peft(model, tmp_path / "p", base_model_name_or_path="tiny")
    config = json.loads((tmp_path / "p" / "adapter_config.json").read_text())
    want_idx = NEW if kind == "gpt2" else {"model.embed_tokens": NEW, "lm_head": NEW}
    assert config["trainable_token_indices"] == want_idx
    base = BUILD[kind]()
    torch.manual_seed(1)
    base.resize_token_embeddings(VOCAB + 2)  # transformers' own init: sampled around the mean
    assert not torch.equal(base.get_input_embeddings().weight[NEW], _base(kind).get_input_embeddings().weight[NEW])
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "p").eval()
    torch.testing.assert_close(_logits(loaded), _logits(model), atol=1e-5, rtol=0)
    ours = _base(kind)                        # and rankwise's own PEFT loader (generate --adapter)
    load_peft(ours, tmp_path / "p")
    assert count_parameters(ours)[0] == count_parameters(model)[0]
    torch.testing.assert_close(_logits(ours), _logits(model), atol=1e-6, rtol=0)
