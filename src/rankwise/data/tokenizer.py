"""Train a tokenizer on a run's own training text (``model.train_tokenizer``), for pretraining.

Two layouts, both saved as an ordinary transformers tokenizer folder (``AutoTokenizer`` loads
it, no rankwise code needed):

* ``sentencepiece`` (default): a SentencePiece BPE (or unigram) model in the Llama-2 layout:
  byte fallback (no text is ever ``<unk>``), digits split, whitespace kept exactly (identity
  normalisation, runs of spaces as pieces, which indentation needs), a dummy space prefix,
  ``<unk>`` / ``<s>`` / ``</s>`` = 0 / 1 / 2. The folder holds the SentencePiece
  ``tokenizer.model`` beside ``tokenizer.json`` (a ``LlamaTokenizer``), so converters and
  servers that read SentencePiece files (llama.cpp's) find it. Needs the ``sentencepiece``
  package (``pip install 'rankwise[pretrain]'``); SentencePiece trains on lines, so a newline is
  always its byte token ``<0x0A>``, as in Llama-2.
* ``byte-bpe``: a byte-level BPE in the GPT-2 layout through ``tokenizers`` (a transformers
  dependency), one ``<|endoftext|>`` token for BOS, EOS and padding.

The text is the training split only (never the held-out records, :func:`training_texts`), read
in record order, so the same data and settings give the same tokenizer.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from rankwise.configs import bounded
from rankwise.errors import RankwiseError, require


@dataclass
class TokenizerTrainConfig:
    """``model.train_tokenizer``: the tokenizer a pretraining run learns from its data.

    Attributes:
        kind: ``sentencepiece`` (SentencePiece BPE/unigram, Llama-2 layout, with
            ``tokenizer.model``) or ``byte-bpe`` (byte-level BPE, GPT-2 layout).
        vocab_size: Tokens in the vocabulary, special and byte tokens included.
        model_type: ``sentencepiece`` only: ``bpe`` or ``unigram``.
        character_coverage: ``sentencepiece`` only: share of characters covered by pieces of
            their own; the rarest ones fall back to bytes.
        max_lines: At most this many non-empty lines train it (evenly spaced over the text when
            there are more: deterministic, no sampling seed).
    """

    kind: Literal["sentencepiece", "byte-bpe"] = "sentencepiece"
    vocab_size: int = bounded(8192, ge=300, le=1_000_000,
                              hint="(the 256 byte tokens and the special tokens need room)")
    model_type: Literal["bpe", "unigram"] = "bpe"
    character_coverage: float = bounded(0.9995, ge=0.9, le=1.0)
    max_lines: int = bounded(2_000_000, ge=1)


def _lines(texts: Iterator[str], max_lines: int) -> list[str]:
    """The non-empty lines of ``texts``, evenly thinned to at most ``max_lines``."""
    lines = [line for text in texts for line in text.split("\n") if line.strip()]
    if len(lines) > max_lines:
        step = len(lines) / max_lines
        lines = [lines[int(i * step)] for i in range(max_lines)]
    return lines


def _sentencepiece(lines: list[str], cfg: TokenizerTrainConfig, folder: Path) -> None:
    """Train the SentencePiece model and write a ``LlamaTokenizer`` folder around it."""
    require("sentencepiece", "pretrain", "model.train_tokenizer.kind: sentencepiece")
    import sentencepiece as spm
    from transformers import AutoTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines), model_prefix=f"{tmp}/sp", vocab_size=cfg.vocab_size,
                model_type=cfg.model_type, byte_fallback=True, split_digits=True,
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True, add_dummy_prefix=True,
                character_coverage=cfg.character_coverage, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                input_sentence_size=0, shuffle_input_sentence=False, num_threads=1, minloglevel=2)
        except RuntimeError as err:  # e.g. a vocabulary larger than the text allows
            raise RankwiseError(f"model.train_tokenizer: SentencePiece refused the settings "
                                f"({str(err).splitlines()[-1]}); lower vocab_size") from None
        src = Path(tmp) / "hf"
        src.mkdir()
        shutil.copy(f"{tmp}/sp.model", src / "tokenizer.model")
        (src / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "legacy": False}))
        tok = AutoTokenizer.from_pretrained(str(src))
        tok.save_pretrained(str(folder))
        shutil.copy(src / "tokenizer.model", folder / "tokenizer.model")  # save_pretrained drops it


def _byte_bpe(lines: list[str], cfg: TokenizerTrainConfig, folder: Path) -> None:
    """Train a byte-level BPE and write a GPT-2-style fast tokenizer folder."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    end = "<|endoftext|>"
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([line + "\n" for line in lines], vocab_size=cfg.vocab_size,
                            min_frequency=2, special_tokens=[end], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=end, eos_token=end,
                                  unk_token=end, pad_token=end)
    tok.save_pretrained(str(folder))


def train_tokenizer(texts: Iterator[str], cfg: TokenizerTrainConfig, folder: Path) -> Any:
    """Train a tokenizer on ``texts`` and save it to ``folder`` (written whole or not at all).

    Args:
        texts: The training text, one document at a time.
        cfg: The ``model.train_tokenizer`` section.
        folder: Where the transformers tokenizer folder goes (must not exist yet).

    Returns:
        The tokenizer, loaded back from ``folder`` with ``AutoTokenizer``.

    Raises:
        RankwiseError: No text, a missing ``sentencepiece`` package, or settings the trainer
            refuses.
    """
    from transformers import AutoTokenizer

    from rankwise.core import atomic
    lines = _lines(texts, cfg.max_lines)
    if not lines:
        raise RankwiseError("model.train_tokenizer: the training data holds no text to learn a "
                            "vocabulary from; check data.source and data.text_field")
    with atomic.folder(Path(folder)) as tmp:
        (_sentencepiece if cfg.kind == "sentencepiece" else _byte_bpe)(lines, cfg, Path(tmp))
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


__all__ = ["TokenizerTrainConfig", "train_tokenizer"]
