"""New tokens for a run: ``model.add_tokens`` / ``model.add_special_tokens`` (the tokenizer gets
them, the embedding grows) and ``method.trainable_tokens`` (which rows train,
:mod:`rankwise.core.tokens`).

New rows start at the mean of the existing rows. That is the init of HF's
``resize_token_embeddings(mean_resizing=True)`` without its noise: transformers samples each
new row from a normal with the old rows' mean and ``1e-9`` times their covariance; the exact
mean is deterministic, so loading the base again for export, ``generate`` or a resume rebuilds
the very same rows the adapter was trained against (its weight checks require that). A new
token's embedding is then "an average token", and its output logit ``h · mean(W)`` is the
average of the old logits, so adding tokens barely moves the model's predictions (Hewitt 2021,
the reason transformers made it the default).
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise.errors import RankwiseError

TOKENIZER_DIR = "tokenizer"  # the run folder's copy of the extended tokenizer


def adds_tokens(model_cfg: Any) -> bool:
    """Whether ``model_cfg`` adds tokens to the tokenizer."""
    return bool(getattr(model_cfg, "add_tokens", None) or getattr(model_cfg, "add_special_tokens", None))


def extend_tokenizer(tok: Any, tokens: list[str] = (), special: list[str] = ()) -> list[int]:
    """Add ``tokens`` and ``special`` tokens to ``tok`` (in place).

    Args:
        tok: A transformers tokenizer.
        tokens: Plain new tokens (``tokenizer.add_tokens``).
        special: New special tokens (never split; dropped by ``skip_special_tokens``).

    Returns:
        The ids of the tokens that were new to the vocabulary, in order (a token the vocabulary
        already holds keeps its id and row).
    """
    before = set(tok.get_vocab())
    if special:
        kw = {k: False for k in ("replace_extra_special_tokens", "replace_additional_special_tokens")
              if k in inspect.signature(tok.add_special_tokens).parameters}
        tok.add_special_tokens({"additional_special_tokens": list(special)}, **kw)
    if tokens:
        tok.add_tokens(list(tokens))
    new = [t for t in dict.fromkeys([*special, *tokens]) if t not in before]
    return [int(i) for i in tok.convert_tokens_to_ids(new)]


def _mean_rows(weight: torch.Tensor, new_ids: list[int], old_rows: int) -> None:
    """Set rows ``new_ids`` of ``weight`` to the mean of its other rows below ``old_rows``."""
    keep = torch.ones(old_rows, dtype=torch.bool, device=weight.device)
    keep[[i for i in new_ids if i < old_rows]] = False
    with torch.no_grad():
        mean = weight[:old_rows][keep].float().mean(0)
        weight[new_ids] = mean.to(weight.dtype)


def resize_for_tokens(model: nn.Module, vocab_size: int, new_ids: list[int]) -> None:
    """Grow the input embedding (and an untied output head) to ``vocab_size`` rows when it has
    fewer, and set the rows of ``new_ids`` to the mean of the existing rows (the mean-embedding
    init used by HF's ``resize_token_embeddings`` with ``mean_resizing``, without its noise;
    see the module docstring). A table that already has spare rows (padded vocabularies) is not
    resized; the new tokens' rows in it are set to the mean all the same.

    Args:
        model: A transformers model.
        vocab_size: ``len(tokenizer)`` after the new tokens.
        new_ids: Ids of the tokens that are new.
    """
    old_rows = model.get_input_embeddings().weight.shape[0]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_rows = head.weight.shape[0] if head is not None else 0
    if vocab_size > old_rows:
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    if not new_ids:
        return
    emb = model.get_input_embeddings()
    _mean_rows(emb.weight, new_ids, old_rows)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and head.weight is not emb.weight:
        _mean_rows(head.weight, new_ids, head_rows)
        if getattr(head, "bias", None) is not None:
            with torch.no_grad():
                head.bias[new_ids] = head.bias[:head_rows].float().mean().to(head.bias.dtype)


def trainable_token_ids(method_cfg: Any, model_cfg: Any, tok: Any) -> list[int]:
    """The ids ``method.trainable_tokens`` names (``true``: the added tokens); empty when off.

    Raises:
        RankwiseError: Tokens the tokenizer lacks (named, with the key that adds them).
    """
    names = getattr(method_cfg, "trainable_tokens", None)
    if not names:
        return []
    if names is True:
        names = [*model_cfg.add_special_tokens, *model_cfg.add_tokens]
    vocab = tok.get_vocab()
    missing = [t for t in dict.fromkeys(names) if t not in vocab]
    if missing:
        raise RankwiseError(f"method.trainable_tokens names tokens the tokenizer lacks: "
                            f"{', '.join(map(repr, missing))}; add them with model.add_special_tokens "
                            "(or model.add_tokens), or name existing tokens")
    return sorted({int(vocab[t]) for t in names})


def apply_trainable_tokens(model: nn.Module, method_cfg: Any, model_cfg: Any, tok: Any,
                           name: str = "default") -> list[int]:
    """Add the trainable-token layers ``method.trainable_tokens`` asks for to an adapted model
    and make only the adapter (and the modules to save) train.

    Returns:
        The trainable token ids (empty: nothing was done).

    Raises:
        RankwiseError: Unknown tokens, or the embedding is also a module to save.
    """
    from rankwise.core.ops import mark_trainable, modules_to_save
    from rankwise.core.tokens import add_trainable_tokens
    ids = trainable_token_ids(method_cfg, model_cfg, tok)
    if not ids:
        return []
    saved = modules_to_save(model)
    emb = model.get_input_embeddings()
    clash = [p for p in saved if any(m is emb for m in model.get_submodule(p).modules())]
    if clash:
        raise RankwiseError(f"method.trainable_tokens trains rows of the embedding, which "
                            f"method.modules_to_save {clash} trains whole; use one of the two")
    add_trainable_tokens(model, ids, name)
    mark_trainable(model, name)
    return ids


def save_tokenizer_files(tok: Any, folder: Path) -> None:
    """``tok.save_pretrained(folder)`` plus the files it leaves behind (transformers 5 writes only
    ``tokenizer.json``, so a SentencePiece ``tokenizer.model``, which llama.cpp's converter and
    slow tokenizers read, is copied from the folder the tokenizer was loaded from):
    :func:`rankwise.core.tokenizer_files.save_tokenizer_files`."""
    from rankwise.core.tokenizer_files import save_tokenizer_files as save
    save(tok, folder)


def save_tokenizer(tok: Any, run_dir: Path) -> Path:
    """Write the run's extended tokenizer to ``RUN/tokenizer`` (atomically)."""
    from rankwise.core import atomic
    with atomic.folder(Path(run_dir) / TOKENIZER_DIR) as tmp:
        save_tokenizer_files(tok, tmp)
    return Path(run_dir) / TOKENIZER_DIR


def run_tokenizer(run_dir: Path, tok: Any) -> Any:
    """The tokenizer a run saved (``RUN/tokenizer``), else ``tok``; it must hold every token of
    ``tok`` under the same id (the base's tokenizer extended by the run's config).

    Raises:
        RankwiseError: If the saved tokenizer disagrees with the rebuilt one.
    """
    folder = Path(run_dir) / TOKENIZER_DIR
    if not folder.is_dir():
        return tok
    from transformers import AutoTokenizer
    saved = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if saved.pad_token is None:
        saved.pad_token = tok.pad_token
    if saved.get_vocab() != tok.get_vocab():
        raise RankwiseError(f"{folder} differs from the base tokenizer extended by model.add_tokens / "
                            "model.add_special_tokens in the run's config.yaml; the base model's "
                            "tokenizer has changed since the run: point --model at the original base")
    return saved
