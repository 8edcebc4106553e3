"""Write a tokenizer with every file of the folder it came from, not only what ``save_pretrained``
writes.

transformers 5 saves a SentencePiece-based tokenizer (Llama-2, Mistral, Gemma, T5 ...) as
``tokenizer.json`` + ``tokenizer_config.json`` only: the SentencePiece ``tokenizer.model`` is
dropped. Everything that reads the SentencePiece file then goes wrong without an error: llama.cpp's
``convert_hf_to_gguf.py`` falls back to a vocabulary built from ``tokenizer.json`` in which every
score is -1000 and ``<unk>`` is a control token, so libllama tokenizes differently from
transformers. :func:`save_tokenizer_files` saves the tokenizer and then copies each tokenizer
asset of its source folder that the save did not write (the SentencePiece model, added tokens,
chat templates), so a converter or a server sees the files the base shipped with.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

# files a tokenizer folder may hold beside the ones its class names in ``vocab_files_names``
ASSETS = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "tokenizer.json",
          "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
          "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json")
TEMPLATES_DIR = "additional_chat_templates"  # transformers' folder of named chat templates


def source_folder(tok: Any) -> Path | None:
    """The local folder ``tok`` was loaded from (its ``name_or_path``), or ``None``."""
    origin = Path(str(getattr(tok, "name_or_path", "") or ""))
    return origin if str(origin) and origin.is_dir() else None


def asset_names(tok: Any) -> list[str]:
    """The file names a tokenizer folder of ``tok``'s class may hold."""
    own = [n for n in getattr(tok, "vocab_files_names", {}).values() if isinstance(n, str)]
    return list(dict.fromkeys([*own, *ASSETS]))


def save_tokenizer_files(tok: Any, folder: str | Path) -> list[str]:
    """``tok.save_pretrained(folder)``, then copy the tokenizer assets of ``tok``'s source folder
    that the save did not write (see the module docstring); a file the save wrote is never
    replaced, so a tokenizer extended in memory keeps its own files.

    Args:
        tok: A transformers tokenizer.
        folder: The target folder (created if needed).

    Returns:
        The names of the files copied from the source folder (empty when ``tok`` was not loaded
        from a local folder or the save wrote everything).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    origin = source_folder(tok)
    if origin is None or origin.resolve() == folder.resolve():
        return []
    copied = []
    for name in asset_names(tok):
        if (origin / name).is_file() and not (folder / name).exists():
            shutil.copy(origin / name, folder / name)
            copied.append(name)
    if (origin / TEMPLATES_DIR).is_dir() and not (folder / TEMPLATES_DIR).exists():
        shutil.copytree(origin / TEMPLATES_DIR, folder / TEMPLATES_DIR)
        copied.append(TEMPLATES_DIR)
    return copied
