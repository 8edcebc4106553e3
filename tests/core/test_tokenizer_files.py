"""Exports keep every tokenizer file of the base: a SentencePiece base built in code (rankwise's
own tokenizer trainer, Llama-2 layout) exported merged keeps ``tokenizer.model`` byte for byte,
and both transformers and SentencePiece itself tokenize a set of prompts as the base does."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import rankwise
from rankwise.core.merged import export_merged
from rankwise.core.tokenizer_files import save_tokenizer_files

spm = pytest.importorskip("sentencepiece")
PROMPTS = ["def add(a, b):\n    return a + b", "The quick brown fox, 12345 times.",
           "  indented   spaces\tand tabs", "Ünïcödé and emoji 🙂 fall back to bytes"]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
         "Rankwise trains low-rank adapters on small models.", "Numbers 12345 and words!"] * 10


@pytest.fixture(scope="module")
def sp_base(tmp_path_factory):
    """A tiny Llama saved with a SentencePiece tokenizer folder (tokenizer.model + chat template)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rankwise.data.tokenizer import TokenizerTrainConfig, train_tokenizer
    root = tmp_path_factory.mktemp("sp")
    tok = train_tokenizer(iter(TEXTS), TokenizerTrainConfig(vocab_size=320), root / "base")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(str(root / "base"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, max_position_embeddings=64))
    model.save_pretrained(root / "base")
    return root / "base", AutoTokenizer.from_pretrained(str(root / "base")), model


def _ids(folder, prompts=PROMPTS):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    return [tok(p)["input_ids"] for p in prompts]


def test_plain_save_pretrained_drops_the_sentencepiece_model(sp_base, tmp_path):
    """The defect this module fixes, as transformers 5 has it."""
    _, tok, _ = sp_base
    tok.save_pretrained(str(tmp_path))
    assert not (tmp_path / "tokenizer.model").exists()


def test_merged_export_keeps_tokenizer_model_and_ids(sp_base, tmp_path):
    base, tok, model = sp_base
    model = copy.deepcopy(model)
    rankwise.apply(model, "lora", r=2, targets=["q_proj", "v_proj"])
    out = export_merged(model, tmp_path / "merged", tokenizer=tok)
    assert (out / "tokenizer.model").read_bytes() == (base / "tokenizer.model").read_bytes()
    assert _ids(out) == _ids(base)
    # SentencePiece itself (what llama.cpp's converter reads) gives transformers' pieces (leading
    # whitespace aside: transformers' non-legacy Llama tokenizer treats it differently from SP)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    plain = [p for p in PROMPTS if not p[0].isspace()]
    assert len(plain) == 3 and [[1, *sp.encode(p)] for p in plain] == _ids(base, plain)
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == tok.chat_template


def test_files_the_save_wrote_are_kept_and_the_rest_copied(sp_base, tmp_path):
    base, tok, _ = sp_base
    from transformers import AutoTokenizer
    extended = AutoTokenizer.from_pretrained(str(base))
    extended.add_tokens(["<tool>"])
    (base / "added_tokens.json").write_text(json.dumps({}))  # an asset the save does not write
    try:
        copied = save_tokenizer_files(extended, tmp_path)
    finally:
        (base / "added_tokens.json").unlink()
    assert copied == ["tokenizer.model", "added_tokens.json"]
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(again) == len(tok) + 1 and again.convert_tokens_to_ids("<tool>") == len(tok)


def test_a_tokenizer_from_nowhere_is_saved_as_it_is(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]")))
    assert save_tokenizer_files(tok, tmp_path) == []
    assert (tmp_path / "tokenizer.json").is_file()
