"""``model.train_tokenizer``: a SentencePiece tokenizer in the Llama-2 layout whose transformers
tokenizer gives SentencePiece's own ids, keeps whitespace, never needs ``<unk>``, and ships its
``tokenizer.model``; a byte-level BPE in the GPT-2 layout; bad settings in one line."""
from __future__ import annotations

import pytest

from rankwise.configs import from_dict
from rankwise.data.corpus import load_source_records
from rankwise.data.tokenizer import TokenizerTrainConfig, train_tokenizer
from rankwise.errors import RankwiseError


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [r["text"] for r in load_source_records() if r["id"].startswith("json.")]


@pytest.fixture(scope="module")
def spm_tok(texts, tmp_path_factory):
    return train_tokenizer(iter(texts), TokenizerTrainConfig(vocab_size=600),
                           tmp_path_factory.mktemp("t") / "tok")


def test_sentencepiece_tokenizer_equals_sentencepiece_and_round_trips(spm_tok, texts):
    import sentencepiece as spm
    folder = spm_tok.name_or_path
    sp = spm.SentencePieceProcessor(model_file=f"{folder}/tokenizer.model")
    assert len(spm_tok) == 600 == sp.get_piece_size()
    assert (spm_tok.unk_token_id, spm_tok.bos_token_id, spm_tok.eos_token_id) == (0, 1, 2)
    for text in texts[:5] + ["def f(x):\n        return  x  # spaces\tand a tab\n"]:
        ids = spm_tok(text, add_special_tokens=False)["input_ids"]
        assert ids == sp.encode(text)                                # the same pieces as SentencePiece
        assert spm_tok.decode(ids) == text                           # indentation and runs of spaces kept
    assert spm_tok("x")["input_ids"][0] == 1                         # BOS in front, no EOS
    unseen = "名前 ∮ 🙂"                                              # not in the json sources
    ids = spm_tok(unseen, add_special_tokens=False)["input_ids"]
    assert 0 not in ids and spm_tok.decode(ids) == unseen            # byte fallback, never <unk>


def test_byte_bpe_tokenizer_round_trips(texts, tmp_path):
    tok = train_tokenizer(iter(texts), TokenizerTrainConfig(kind="byte-bpe", vocab_size=500), tmp_path / "b")
    assert len(tok) == 500 and tok.eos_token == tok.pad_token == "<|endoftext|>"
    text = texts[0][:800] + "\n名前"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_only_the_training_text_and_settings_errors(tmp_path):
    with pytest.raises(RankwiseError, match="holds no text"):
        train_tokenizer(iter(["", "  \n"]), TokenizerTrainConfig(), tmp_path / "none")
    assert not (tmp_path / "none").exists()                          # nothing half written
    with pytest.raises(RankwiseError, match=r"model.train_tokenizer.vocab_size: got 10; expected an integer in 300\.\.1000000"):
        from_dict(TokenizerTrainConfig, {"vocab_size": 10}, "model.train_tokenizer")
