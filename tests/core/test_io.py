"""rankwise adapter format: round trip, fingerprint mismatch, corrupt files, atomic replacement."""
from __future__ import annotations

import json

import pytest
import torch

from rankwise.adapters.lora import LoraConfig, apply_lora
from rankwise.core.io import CONFIG, WEIGHTS, fingerprint, load_adapter, read_adapter, save_adapter
from rankwise.errors import RankwiseError
from rankwise.testing import tiny_batch, tiny_bert_cls, tiny_gpt2_lm

CFG = LoraConfig(r=4, alpha=8, targets=["query", "value"], rank_pattern={"value": 2})


def _logits(model, kind="bert"):
    batch = {k: v for k, v in tiny_batch(kind).items() if k != "labels"}
    with torch.no_grad():
        return model(**batch).logits


def _trained(tmp_path):
    model = tiny_bert_cls()
    apply_lora(model, CFG)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    save_adapter(model, tmp_path / "ad", CFG)
    return model


def test_round_trip_reproduces_outputs_and_structure(tmp_path):
    model = _trained(tmp_path)
    meta, tensors = read_adapter(tmp_path / "ad")
    assert meta["fingerprint"] == fingerprint(tiny_bert_cls()) == fingerprint(model)
    assert meta["structure"]["bert.encoder.layer.0.attention.self.value"] == \
        {"r": 2, "alpha": 8.0, "use_rslora": False, "scale": 4.0}
    assert meta["modules_to_save"] == ["classifier"] and len(tensors) == 8 + 2
    fresh = tiny_bert_cls()
    load_adapter(fresh, tmp_path / "ad")
    torch.testing.assert_close(_logits(fresh), _logits(model), atol=0, rtol=0)
    trainable = {n for n, p in fresh.named_parameters() if p.requires_grad}
    assert "classifier.weight" in trainable and len(trainable) == 10


def test_other_base_model_is_refused_naming_both(tmp_path):
    _trained(tmp_path)
    with pytest.raises(RankwiseError) as err:
        load_adapter(tiny_gpt2_lm(), tmp_path / "ad")
    msg = str(err.value)
    assert "BertForSequenceClassification" in msg and "GPT2LMHeadModel" in msg
    with pytest.raises(RankwiseError, match="fingerprint"):
        load_adapter(tiny_bert_cls(num_labels=5), tmp_path / "ad")  # same class, other shapes


def test_corrupt_files_are_user_errors(tmp_path):
    _trained(tmp_path)
    (tmp_path / "ad" / WEIGHTS).write_bytes(b"\x00" * 20)
    with pytest.raises(RankwiseError, match="corrupt"):
        load_adapter(tiny_bert_cls(), tmp_path / "ad")
    (tmp_path / "ad" / CONFIG).write_text("{not json")
    with pytest.raises(RankwiseError, match="corrupt"):
        load_adapter(tiny_bert_cls(), tmp_path / "ad")
    (tmp_path / "ad" / CONFIG).write_text(json.dumps({"format": "other"}))
    with pytest.raises(RankwiseError, match="corrupt"):
        read_adapter(tmp_path / "ad")
    with pytest.raises(RankwiseError, match="not a rankwise adapter folder"):
        read_adapter(tmp_path / "missing")
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "adapter_config.json").write_text("{}")
    with pytest.raises(RankwiseError, match="load_peft"):
        read_adapter(tmp_path / "peft")


def test_failed_save_keeps_previous_folder(tmp_path):
    model = _trained(tmp_path)
    before = (tmp_path / "ad" / WEIGHTS).read_bytes()
    with pytest.raises(TypeError):  # metadata that cannot be JSON: fails mid-write
        save_adapter(model, tmp_path / "ad", CFG, extra={"bad": object()})
    assert (tmp_path / "ad" / WEIGHTS).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad"]  # no temporary left behind


def test_same_shapes_other_weights_are_refused(tmp_path):
    """The shape fingerprint alone accepts a base with other weights; the weight sample (16
    values from each embedding table) does not."""
    _trained(tmp_path)
    other = tiny_bert_cls(seed=1)
    assert fingerprint(other) == fingerprint(tiny_bert_cls())
    with pytest.raises(RankwiseError, match="trained on other weights") as err:
        load_adapter(other, tmp_path / "ad")
    assert "bert.embeddings" in str(err.value) and "base model it was trained on" in str(err.value)
    meta, _ = read_adapter(tmp_path / "ad")
    tables = meta["weight_sample"]["tables"]
    # word, position and token-type tables; the trained head (modules_to_save) is not sampled
    assert sorted(tables) == ["bert.embeddings.position_embeddings.weight",
                              "bert.embeddings.token_type_embeddings.weight",
                              "bert.embeddings.word_embeddings.weight"]
    assert all(len(v) == 16 for v in tables.values()) and meta["weight_sample"]["dtype"] == "float32"
    word = tiny_bert_cls().bert.embeddings.word_embeddings.weight.reshape(-1)
    n = word.numel()
    idx = [k * (n // 16) + (k * 7919) % (n // 16) for k in range(16)]  # one per sixteenth
    assert tables["bert.embeddings.word_embeddings.weight"] == word[idx].double().tolist()


def test_one_changed_sampled_value_is_refused_and_other_dtypes_round(tmp_path):
    _trained(tmp_path)
    meta, _ = read_adapter(tmp_path / "ad")
    value = meta["weight_sample"]["tables"]["bert.embeddings.word_embeddings.weight"][3]
    n = tiny_bert_cls().bert.embeddings.word_embeddings.weight.numel()
    i = 3 * (n // 16) + (3 * 7919) % (n // 16)
    nudged = tiny_bert_cls()
    with torch.no_grad():
        nudged.bert.embeddings.word_embeddings.weight.view(-1)[i] = value * (1 + 2**-20)
    with pytest.raises(RankwiseError, match="word_embeddings.weight differs"):
        load_adapter(nudged, tmp_path / "ad")
    # the same base stored in bf16 (an adapter trained on it loads onto the float32 original)
    load_adapter(tiny_bert_cls().to(torch.bfloat16), tmp_path / "ad")
    # ...but a bf16 base whose value is off by more than bf16's rounding (2**-7) is refused
    off = tiny_bert_cls()
    with torch.no_grad():
        off.bert.embeddings.word_embeddings.weight.view(-1)[i] = value * (1 + 2**-5)
    with pytest.raises(RankwiseError, match="trained on other weights"):
        load_adapter(off.to(torch.bfloat16), tmp_path / "ad")


def test_an_adapter_without_a_weight_sample_loads_with_a_warning(tmp_path):
    model = _trained(tmp_path)
    meta = json.loads((tmp_path / "ad" / CONFIG).read_text())
    del meta["weight_sample"]                     # what rankwise wrote before it kept one
    (tmp_path / "ad" / CONFIG).write_text(json.dumps(meta))
    fresh = tiny_bert_cls(seed=1)                 # unnoticed, as before: only shapes are known
    with pytest.warns(UserWarning, match="no weight checksum"):
        load_adapter(fresh, tmp_path / "ad")
    fresh = tiny_bert_cls()
    with pytest.warns(UserWarning, match="no weight checksum"):
        load_adapter(fresh, tmp_path / "ad")
    torch.testing.assert_close(_logits(fresh), _logits(model), atol=0, rtol=0)
