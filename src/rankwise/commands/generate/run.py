"""``rankwise generate RUN_DIR --prompt TEXT | --file PROMPTS.jsonl``: completions from a run.

The base model named by the run's ``config.yaml`` (in its dtype / quantization) gets the run's
adapter (``adapter/``, or ``model/`` for full fine-tuning) or, with ``--adapter``, a PEFT adapter
folder. Prompts are formatted as the run's ``data.format`` formatted them in training: the chat
template for ``chat`` runs, ``prefix + prompt`` for ``prompt-completion`` (training's
``samples.jsonl`` callback is :func:`rankwise.recipes.reports.samples_callback`). How it decodes is one
:class:`~rankwise.commands.generate.decode.DecodeConfig` (``--set decode.*``, a ``decode:`` section, or
the flags that fill it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from rankwise import registry
from rankwise.data.files import json_lines
from rankwise.data.formats import Encoder, end_id
from rankwise.data.presets import prompt_key
from rankwise.data.text import encoder_for
from rankwise.engine import get_task
from rankwise.engine.generation import generate
from rankwise.errors import RankwiseError
from rankwise.recipes import folders
from rankwise.commands.generate.decode import DecodeConfig, SteerConfig, checked
from rankwise.recipes.config import RunConfig, load_run_config
from rankwise.recipes.model import base_moved, load_model


def _decoder(tokenizer) -> Callable[[list[int]], str]:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def load_for_generation(run_dir: Path, adapter: Path | None = None, device: str = "cpu",
                        model_path: Path | None = None) -> tuple[RunConfig, Any, Any, Encoder]:
    """Rebuild a run's model for generation.

    Args:
        run_dir: A finished causal-LM run folder.
        adapter: A PEFT adapter folder to use instead of the run's own adapter.
        device: Where the model goes.
        model_path: The base model's folder, when it is no longer at the run's ``model.path``.

    Returns:
        ``(cfg, model, tokenizer, encoder)``; the encoder formats prompts as in training.

    Raises:
        RankwiseError: Not a run folder, not a causal-LM run, no trained result yet, or a bad
            adapter / chat template.
    """
    from rankwise.core.io import load_adapter
    run_dir = Path(run_dir)
    folders.check_run(run_dir, "generate")
    if not (run_dir / "config.yaml").is_file():
        raise RankwiseError(f"{run_dir} is not a run folder (no config.yaml); pass the --out folder "
                            "of a finished 'rankwise train'")
    cfg = load_run_config(run_dir / "config.yaml", notice=False)
    task = get_task(cfg.task.name)
    if task.uses_labels:
        raise RankwiseError(f"run {run_dir} trained a {task.name} model; generate needs a "
                            "causal-lm run (task.name: causal-lm)")
    m = cfg.model
    full = registry.get("method", cfg.method.name).trains == "full" and adapter is None
    if full and model_path is not None:
        raise RankwiseError(f"run {run_dir} trained every weight: its model is {run_dir / 'model'}, "
                            "so --model does not apply; leave it out")
    if model_path is not None:
        m.path = str(model_path)
    path = str(run_dir / "model") if full else m.path
    if full and not (run_dir / "model" / "config.json").is_file():
        raise RankwiseError(f"{run_dir} has no trained model/ yet; let the run finish (or --resume it)")
    if not full and adapter is None and not (run_dir / "adapter").is_dir():
        raise RankwiseError(f"{run_dir} has no adapter/ yet; let the run finish (or --resume it)")
    try:
        tokens = {} if full else {"add_tokens": m.add_tokens, "add_special_tokens": m.add_special_tokens}
        model, tok = load_model(path, task, seed=cfg.train.seed, dtype=m.dtype, quantize=m.quantize,
                                double_quant=m.double_quant, device=device, **tokens)
    except RankwiseError as err:
        if full or "not found" not in str(err):
            raise
        raise base_moved(err) from None
    if not full:
        from rankwise.recipes.tokens import run_tokenizer
        tok = run_tokenizer(run_dir, tok)  # the run's own copy when it added tokens
    if adapter is not None:  # the format's registered loader (the LoRA package's, for peft)
        registry.get("exporter", "peft").loader(model, adapter)
    elif not full:
        load_adapter(model, run_dir / "adapter")
    if not m.quantize:
        model.to(device)
    model.eval()
    return cfg, model, tok, encoder_for(cfg.data, task, tok)


def start_id(tokenizer, model) -> int:
    """The token an empty prompt starts from: BOS, as ``transformers``' ``generate()`` starts
    when given no input (the tokenizer's BOS, else the model's ``generation_config``'s).

    Raises:
        RankwiseError: If neither defines one.
    """
    gen = getattr(model, "generation_config", None)
    for tid in (tokenizer.bos_token_id, getattr(gen, "bos_token_id", None)):
        if isinstance(tid, int):
            return tid
    raise RankwiseError("an empty prompt starts from the BOS token, and neither the tokenizer nor "
                        "the model defines one; give a non-empty prompt")


def read_prompts(path: Path, enc: Encoder) -> Iterator[Any]:
    """Yield the prompts of a JSONL file: the ``data.prompt_field`` text of each line, or its
    ``data.messages_field`` list for chat runs (a plain JSON string is taken as the prompt);
    ``data.format: alpaca`` runs read Alpaca records, ``sharegpt`` runs their ``conversations``.

    Raises:
        RankwiseError: A missing file, a line that is not JSON, or a line without the field.
    """
    path = Path(path)
    if not path.is_file():
        raise RankwiseError(f"prompts file {path} not found; pass a .jsonl file with one "
                            "{\"prompt\": ...} object per line")
    field = prompt_key(enc.preset) or (enc.messages_field if enc.fmt == "chat" else enc.prompt_field)
    for n, obj in json_lines(path, f"{path} "):
        if isinstance(obj, str) and enc.fmt != "chat":
            yield obj
        elif isinstance(obj, dict) and obj.get(field) is not None:
            yield obj if enc.preset == "alpaca" else obj[field]  # alpaca: instruction and input
        else:
            raise RankwiseError(f"{path} line {n} has no {field!r} field; each line needs one")


def run_generate(run_dir: Path, prompts: str | Path | list, decode: DecodeConfig | None = None, *,
                 adapter: Path | None = None, model_path: Path | None = None,
                 echo: Callable[[str], None] = print, stream: Callable[[str], None] | None = None,
                 note: Callable[[str], None] | None = None) -> list[dict]:
    """Generate completions for one prompt, a list of prompts or a file of prompts, through the
    one decode loop (:func:`rankwise.engine.generation.generate`) with what ``decode`` hands it:
    a fresh KV cache per prompt, and SVDecode's or a Memory Decoder's logits hook.

    Args:
        run_dir: A finished causal-LM run.
        prompts: One prompt (``str``: text; for chat runs, the user message; it streams), a list
            of prompt values (as a prompts file's lines hold), or a JSONL file (``Path``,
            :func:`read_prompts`). An empty prompt generates from the BOS token alone
            (:func:`start_id`).
        decode: How to decode (:class:`~rankwise.commands.generate.decode.DecodeConfig`; its defaults if
            None); checked here like the CLI's.
        adapter: A PEFT adapter folder instead of the run's adapter.
        model_path: ``--model``: the base model's folder, if it moved since training.
        echo: Receives one JSON line per completion (a list or file) or the final newline.
        stream: Receives text pieces as they are generated (one ``str`` prompt).
        note: Receives SVDecode's calibration line (μ*, the applied μ, whether it was clipped);
            default: nowhere.

    Returns:
        ``[{"prompt", "completion"}]``.

    Raises:
        RankwiseError: Bad decoding settings (every one at once), or a bad run, adapter,
            warm-start run, memory decoder or prompts file.
    """
    dc = checked(decode or DecodeConfig())
    from rankwise.compress.kv import build_cache, find_rotary
    steerer = _steerer(run_dir, dc.steer)
    if dc.memory.path is not None:
        check_memory_decoder(Path(dc.memory.path))  # before any model is loaded
    file = Path(prompts) if isinstance(prompts, Path) else None
    if file is not None and file.is_file() and not file.read_text(errors="replace").strip():
        raise RankwiseError(f"prompts file {file} is empty; write one {{\"prompt\": ...}} object "
                            "per line (or pass --prompt TEXT)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg, model, tok, enc = load_for_generation(run_dir, adapter, device, model_path)
    hooks = _hooks(run_dir, dc, steerer, adapter, model, tok, device, model_path, note)
    single = isinstance(prompts, str)
    if single:
        items: list[Any] = [[{"role": "user", "content": prompts}] if enc.fmt == "chat" else prompts]
    else:
        items = list(read_prompts(file, enc)) if file is not None else list(prompts)
    ids = [enc.prompt_ids(v) for v in items]  # every prompt is checked before generating
    if not all(ids):  # an empty prompt: start from BOS, as transformers' generate() without input
        bos = start_id(tok, model)
        ids = [x or [bos] for x in ids]
    decoder = _decoder(tok)
    torch.manual_seed(dc.seed)
    out = []
    for value, prompt_ids in zip(items, ids):
        # a float cache: the model's own (TPA keeps its factor cache); NSNQuant: keys before RoPE
        cache = None if dc.kv_cache.quantizers() is None else build_cache(
            dc.kv_cache, model.config, rotary=find_rotary(model))
        new = generate(model, prompt_ids, dc.max_new_tokens, end_id(tok), tok.pad_token_id,
                       dc.temperature, dc.top_p, device, decode=decoder,
                       on_text=stream if single and stream is not None else None, cache=cache,
                       top_k=dc.top_k, hooks=hooks)
        row = {"prompt": value, "completion": decoder(new)}
        out.append(row)
        echo("" if single and stream is not None else json.dumps(row, ensure_ascii=False))
    return out


def _hooks(run_dir: Path, dc: DecodeConfig, steerer: Any, adapter: Path | None, model: Any, tok: Any,
           device: str, model_path: Path | None, note: Callable[[str], None] | None) -> list[Any]:
    """The logits hooks ``dc`` asks for: SVDecode's (its warm run loaded, μ calibrated) or a
    Memory Decoder's mixture (loaded and checked against the base's tokenizer)."""
    if steerer is not None:
        from rankwise.engine.svdecode import SteerHook
        steer_from = Path(dc.steer.from_)
        warm = None
        if adapter is not None or steer_from.resolve() != Path(run_dir).resolve():
            warm = load_for_generation(steer_from, None, device, model_path)[1]
        if steerer.config.strength != 0 and steerer.fit is None:
            _calibrate(steerer, steer_from, model, warm, tok, device, note)
        return [SteerHook(steerer, model, warm)]
    if dc.memory.path is not None:
        from rankwise.tasks.memory_decoder.generation import MemoryMixture
        memory, lam = load_memory_decoder(Path(dc.memory.path), tok, device, dc.memory.lam)
        return [MemoryMixture(memory, lam)]
    return []


def _calibrate(steerer: Any, steer_from: Path, model: Any, warm: Any, tok: Any, device: str,
               note: Callable[[str], None] | None) -> None:
    """Calibrate SVDecode's μ on the first ``calib_examples`` training examples of the warm-start
    run's own data (its ``data:`` section, read as in training)."""
    from rankwise.data.text import build_data
    warm_cfg = load_run_config(steer_from / "config.yaml")
    train = build_data(warm_cfg.data, get_task(warm_cfg.task.name), tok)[0]
    fit = steerer.calibrate(model, train, warm, device)
    if note is not None:
        note(fit.line())


def _steerer(run_dir: Path, steer: SteerConfig | None) -> Any:
    """The :class:`~rankwise.engine.svdecode.SVDecode` of ``decode.steer`` (None without it),
    checked before any model is loaded.

    Raises:
        RankwiseError: A steering run that is not a run folder, not an adapter run, or one of
            another base.
    """
    if steer is None:
        return None
    steerer = registry.get("steer", steer.name).builder(steer)
    steer_from = Path(steer.from_)
    if not (steer_from / "config.yaml").is_file():
        raise RankwiseError(f"--steer-from {steer_from} is not a run folder (no config.yaml); pass "
                            "the --out folder of a warm-start 'rankwise train'")
    warm_cfg = load_run_config(steer_from / "config.yaml", notice=False)
    if registry.get("method", warm_cfg.method.name).trains == "full":
        raise RankwiseError(f"--steer-from {steer_from} trained every weight, so it has no adapters "
                            "to switch off for the base distribution; steer from an adapter run")
    if Path(run_dir).resolve() != steer_from.resolve() and (Path(run_dir) / "config.yaml").is_file():
        base = load_run_config(Path(run_dir) / "config.yaml", notice=False).model
        if (base.path, base.add_tokens) != (warm_cfg.model.path, warm_cfg.model.add_tokens):
            raise RankwiseError(f"--steer-from {steer_from} was trained on base {warm_cfg.model.path!r} "
                                f"but {run_dir} on {base.path!r}; steer from a warm-start run of the "
                                "same base model")
    return steerer


def same_tokenizer(base, memory, where: str) -> None:
    """Refuse a Memory Decoder whose tokenizer differs from the base's (the mixture adds
    probabilities of the same token ids).

    Raises:
        RankwiseError: One line naming the first difference.
    """
    a, b = base.get_vocab(), memory.get_vocab()
    if a == b:
        return
    diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
    raise RankwiseError(f"the memory decoder {where} has another tokenizer than the base ({len(b)} vs "
                        f"{len(a)} tokens; first difference: token {diff[0][0]!r} id {diff[0][1]}); "
                        "train the memory decoder with the base model's tokenizer")


def check_memory_decoder(path: Path) -> None:
    """Refuse a ``--memory-decoder`` folder that holds no Memory Decoder: only a ``task.name:
    memory-decoder`` run, or a causal-LM model folder (such a run's ``model/``), is mixed in.

    Raises:
        RankwiseError: A run of another task (a plain LoRA run, say), another command's output,
            or a missing / empty folder; one line naming what to pass.
    """
    fix = "pass the --out folder of a task.name: memory-decoder run (docs/memory-decoder.md)"
    found = folders.kind(path) if path.is_dir() else None
    if found == "model":
        return
    if found == "train" and (path / "config.yaml").is_file():
        cfg = load_run_config(path / "config.yaml", notice=False)
        if cfg.task.name == "memory-decoder":
            return
        raise RankwiseError(f"--memory-decoder {path} is a {cfg.task.name} run (method "
                            f"{cfg.method.name}), not a memory-decoder run; {fix}")
    held = folders.what(found) if found else "nothing (missing or empty)"
    raise RankwiseError(f"--memory-decoder {path} holds {held}, not a memory-decoder run; {fix}")


def load_memory_decoder(path: Path, base_tokenizer, device: str, lam: float | None) -> tuple[Any, float]:
    """``(model, lambda)`` of a Memory Decoder folder: a ``task.name: memory-decoder`` run (its
    ``task.lam`` is the default ``lambda``) or a causal-LM model folder.

    Raises:
        RankwiseError: Not such a folder, another tokenizer than the base's, or ``lam`` outside [0, 1].
    """
    from rankwise.tasks.memory_decoder.task import MemoryDecoderConfig
    default = MemoryDecoderConfig().lam
    if (path / "config.yaml").is_file():
        cfg, memory, tok, _ = load_for_generation(path, device=device)
        if isinstance(cfg.task, MemoryDecoderConfig):
            default = cfg.task.lam
    elif (path / "config.json").is_file():
        memory, tok = load_model(str(path), get_task("causal-lm"), device=device)
        memory.to(device).eval()
    else:
        raise RankwiseError(f"--memory-decoder {path} is neither a run folder (config.yaml) nor a model "
                            "folder (config.json); pass the --out folder of a memory-decoder run")
    lam = default if lam is None else lam
    if not 0.0 <= lam <= 1.0:
        raise RankwiseError(f"--memory-lambda: got {lam}; expected a value in [0, 1]")
    same_tokenizer(base_tokenizer, tok, str(path))
    return memory, lam


__all__ = ["same_tokenizer", "check_memory_decoder", "load_memory_decoder", "run_generate", "load_for_generation", "read_prompts"]
