"""Token windows of the standard library's modules for a base with its own tokenizer (the
reference base), and the UTF-8 bytes each token stands for, so a loss per token is also a loss
per byte.

The split is ``data.source: stdlib-source``'s (:func:`rankwise.data.corpus.load_source_records`:
whole modules held out by ``crc32(module) % 10 == 0``), the one the reference base was trained
and evaluated on. Each module is encoded as its model card encodes it, ``BOS + text + EOS``, and
the modules of a split are concatenated into one token stream; windows are cut from that stream
at evenly spaced starts (no draw: the same windows on every machine).

Bytes per token: a SentencePiece piece stands for its text with ``▁`` as a space, a byte-fallback
piece ``<0xNN>`` for one byte, a special token for none; a dummy ``▁`` the tokenizer puts in
front of a module's first piece (Llama-2 layout) is not the module's text and is not counted. Summed over a whole
split this is the split's UTF-8 byte count exactly (tested on a trained tokenizer).
"""
from __future__ import annotations

import re

import torch

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def piece_bytes(tok) -> list[int]:
    """UTF-8 bytes of the text each token id of a SentencePiece-style tokenizer stands for.

    Args:
        tok: A transformers tokenizer with SentencePiece pieces (``▁`` for a space, byte fallback).

    Returns:
        ``bytes[id]`` for every id of the vocabulary (special tokens: 0).

    Raises:
        RankwiseError: If the vocabulary has no byte-fallback pieces (not SentencePiece-style:
            a byte-level BPE's pieces spell bytes differently).
    """
    from rankwise.errors import RankwiseError
    special = set(tok.all_special_ids)
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    if not any(p and _BYTE_PIECE.fullmatch(p) for p in pieces):
        raise RankwiseError("bytes per token: the tokenizer has no <0xNN> byte pieces; this counts "
                            "SentencePiece-style pieces only (the reference base's)")
    out = []
    for i, p in enumerate(pieces):
        if i in special or p is None:
            out.append(0)
        elif _BYTE_PIECE.fullmatch(p):
            out.append(1)
        else:
            out.append(len(p.replace("\u2581", " ").encode("utf-8")))
    return out


def module_stream(tok, heldout: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One split's modules as one token stream, with the bytes of each token.

    Args:
        tok: The base's tokenizer.
        heldout: The held-out modules (``False``: the training modules).

    Returns:
        ``(ids, nbytes, info)``: 1-D long tensors of the same length, and
        ``{"modules", "tokens", "bytes"}`` of the split (bytes: the modules' UTF-8 text).
    """
    from rankwise.data.corpus import load_source_records
    texts = [r["text"] for r in load_source_records() if r["heldout"] == heldout]
    table = piece_bytes(tok)
    prefix = sum(table[i] for i in tok("a", add_special_tokens=False)["input_ids"]) - 1  # a dummy "▁"?
    ids: list[int] = []
    nbytes: list[int] = []
    for text, enc in zip(texts, tok(texts, add_special_tokens=False)["input_ids"]):
        counts = [table[i] for i in enc]
        if prefix and enc:
            counts[0] -= min(prefix, counts[0])           # the dummy prefix is not the module's text
        ids += [tok.bos_token_id, *enc, tok.eos_token_id]
        nbytes += [0, *counts, 0]
    info = {"modules": len(texts), "tokens": len(ids), "bytes": sum(len(t.encode("utf-8")) for t in texts)}
    return torch.tensor(ids, dtype=torch.long), torch.tensor(nbytes, dtype=torch.long), info


def spaced_windows(ids: torch.Tensor, nbytes: torch.Tensor, n: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` windows of ``seq`` tokens at evenly spaced starts over the stream.

    Returns:
        ``(windows, window_bytes)``, both ``(n, seq)``.

    Raises:
        ValueError: If the stream is shorter than one window.
    """
    if ids.numel() < seq:
        raise ValueError(f"a stream of {ids.numel()} tokens is shorter than one window of {seq}")
    starts = torch.linspace(0, ids.numel() - seq, n).long()
    span = starts[:, None] + torch.arange(seq)  # (n, seq)
    return ids[span], nbytes[span]


def scored_bytes(window_bytes: torch.Tensor) -> int:
    """Bytes of the tokens a causal LM predicts in these windows (every position but the first)."""
    return int(window_bytes[:, 1:].sum())


def base_info(folder, model, tok, train_info: dict, held_info: dict, held: torch.Tensor,
              held_win_bytes: torch.Tensor) -> dict:
    """What a benchmark on a base model records about it: its folder (relative to the
    checkout), parameters, vocabulary, shape, the modules its windows came from, the scored
    tokens and bytes of the held-out windows ``held``, and the model card's held-out line."""
    import json
    from pathlib import Path

    from rankwise_bench.common import ROOT
    folder = Path(folder)
    try:
        where = folder.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        where = str(folder)
    c = model.config
    info = {"base": where, "params": sum(p.numel() for p in model.parameters()), "vocab": len(tok),
            "shape": {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
                      "kv_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                      "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                      "intermediate": c.intermediate_size},
            "train_modules": train_info, "heldout_modules": held_info,
            "scored_tokens": int(held.shape[0] * (held.shape[1] - 1)), "scored_bytes": scored_bytes(held_win_bytes)}
    card = folder / "card.json"
    if card.is_file():
        info["card_heldout"] = json.loads(card.read_text()).get("heldout")
    return info


def tiny_base(folder):
    """A base for the benchmarks' tests: a 2-layer Llama (64 wide, 2 heads of 32, 1 KV head)
    with a SentencePiece tokenizer of 512 trained on 100 training modules, saved to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rankwise.data.corpus import load_source_records
    from rankwise.data.tokenizer import TokenizerTrainConfig, train_tokenizer
    texts = [r["text"] for r in load_source_records() if not r["heldout"]][:100]
    tok = train_tokenizer(iter(texts), TokenizerTrainConfig(vocab_size=512), folder)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=64, tie_word_embeddings=True)).save_pretrained(folder)
    return folder
