"""``rankwise merge RUN_OR_ADAPTER... --method M --weights W1,W2,... --out DIR [--merged]``
(or ``--config FILE`` with ``rule: {name: ties, density: 0.5}``).

Combines LoRA adapters trained on one base model into one adapter, with the semantics of HF
PEFT's ``add_weighted_adapter`` (the maths and the papers: :mod:`rankwise.commands.merge.combine`;
the rules, registry kind ``merge-rule``: :mod:`rankwise.commands.merge.rules`). The
inputs are finished ``rankwise train`` runs, rankwise adapter folders (``export --format
rankwise``) or PEFT LoRA folders (``export --format peft``, ``PeftModel.save_pretrained``).

The base model is loaded once (the first run's ``model`` section, ``--model``, or the PEFT
folders' ``base_model_name_or_path``); every input is loaded onto it as its own adapter (rankwise
files through ``core.io``, which checks the base's fingerprint and weight sample; PEFT files through
the ``peft`` exporter's registered loader, which checks module names and shapes); the combined
pair of every layer becomes a new LoRA adapter with scale 1 (``lora_alpha = r``, as PEFT makes
it), written as a PEFT folder in ``--out`` (and, with ``--merged``, folded into the base as a
transformers model in ``--out/merged``). Inputs recorded against different bases (their
fingerprints differ, or PEFT folders name different bases) are refused before any model loads.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rankwise import configs, registry
from rankwise.commands.merge.combine import MergeRule, Pair
from rankwise.commands.merge.config import MergeConfig
from rankwise.commands.merge.rules import LinearConfig, SVDConfig, build_rule
from rankwise.core import atomic
from rankwise.core.io import CONFIG as RANKWISE_CONFIG
from rankwise.core.io import fingerprint, load_adapter, rebuild
from rankwise.core.ops import delete_adapter, modules_to_save
from rankwise.core.protocol import adapter_modules, describe, factors
from rankwise.errors import RankwiseError
from rankwise.recipes import folders
from rankwise.recipes.config import ModelConfig, load_run_config
from rankwise.recipes.model import base_moved, demo_model_path, load_model, torch_dtype

PEFT_TASKS = {"CAUSAL_LM": "causal-lm", "SEQ_CLS": "classification"}
MERGED = "merged"  # the combined adapter's name in the model, and --merged's subfolder
PEFT_CONFIG = "adapter_config.json"
RECORD = "merge.json"  # what was merged, beside the PEFT files
# DoRA's trained magnitude has no weighted-sum rule; PEFT 0.21's add_weighted_adapter accepts
# DoRA inputs but starts the result's magnitude afresh from ||W + BA||, dropping what was trained
DORA = ("{label} adapts {path!r} with DoRA (method.use_dora: true: a trained magnitude beside the "
        "LoRA pair); merge combines plain LoRA adapters only (use_dora: false): export the run "
        "with --format merged instead, or train it without use_dora")


@dataclass
class Source:
    """One input: its folder, its kind (``train``, ``adapter``, ``peft``) and what it records."""
    path: Path
    kind: str
    base: str | None  # the base model's path or name as recorded
    fingerprint: str | None = None  # rankwise files only
    model: ModelConfig | None = None  # runs only
    seed: int = 0
    task: str = "causal-lm"  # runs: their task.name


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        raise RankwiseError(f"{path} is corrupt ({err}); re-export the adapter") from None
    return data


def _source(path: Path) -> Source:
    found = folders.kind(path)
    if found == "train":
        if not (path / "adapter" / RANKWISE_CONFIG).is_file():
            raise RankwiseError(f"{path} has no adapter/ (a full fine-tune, or not finished); merge "
                                "reads LoRA adapters: let the run finish (or --resume it)")
        cfg = load_run_config(path / "config.yaml", notice=False)
        meta = _json(path / "adapter" / RANKWISE_CONFIG)
        return Source(path / "adapter", "train", cfg.model.path, meta.get("fingerprint"), cfg.model,
                      cfg.train.seed, cfg.task.name)
    if found == "adapter":
        meta = _json(path / RANKWISE_CONFIG)
        return Source(path, "adapter", meta.get("base_model"), meta.get("fingerprint"))
    if found in ("peft", "merge"):  # an earlier merge's output is a PEFT LoRA folder
        return Source(path, "peft", _json(path / PEFT_CONFIG).get("base_model_name_or_path"))
    return _bad(path, found)


def _bad(path: Path, found: str | None) -> Source:
    what = folders.WHAT.get(found, "nothing") if found else "nothing"
    raise RankwiseError(f"{path} holds {what}; merge reads finished train runs, rankwise adapter "
                        "folders or PEFT LoRA folders")


def check_same_base(sources: list[Source], model_path: Path | None) -> None:
    """Refuse inputs recorded against different base models (one line naming two of them).

    rankwise files record the base's fingerprint (parameter names and shapes); PEFT folders only
    the base's name, which must then agree with the others' unless ``--model`` names the base.
    """
    printed = [s for s in sources if s.fingerprint]
    for s in printed[1:]:
        if s.fingerprint != printed[0].fingerprint:
            a, b = printed[0], s
            raise RankwiseError(f"cannot merge adapters of different base models: {a.path} was "
                                f"trained on {a.base!r} (fingerprint {a.fingerprint}), {b.path} on "
                                f"{b.base!r} (fingerprint {b.fingerprint}); merge adapters of one base")
    if model_path is not None:
        return
    named = [s for s in sources if s.kind != "adapter" and s.base]
    for s in named[1:]:
        if str(s.base) != str(named[0].base):
            raise RankwiseError(f"cannot merge adapters of different base models: {named[0].path} "
                                f"names {named[0].base!r}, {s.path} names {s.base!r}; merge adapters "
                                "of one base (pass --model DIR if both names are that one model)")


def _load_base(sources: list[Source], model_path: Path | None):
    run = next((s for s in sources if s.model is not None), None)
    if run is not None:
        m, seed, task = run.model, run.seed, run.task
    else:
        base = next((s.base for s in sources if s.base), None)
        if base is None and model_path is None:
            raise RankwiseError("no input names its base model; pass --model DIR")
        task = "causal-lm"
        for s in sources:
            if s.kind == "peft":
                t = _json(s.path / PEFT_CONFIG).get("task_type")
                if t is None:  # a PEFT model saved without a task: a causal LM's body is the guess
                    continue
                if t not in PEFT_TASKS:
                    raise RankwiseError(f"{s.path}: task_type {t!r}; merge loads bases of "
                                        f"task types {sorted(PEFT_TASKS)}")
                task = PEFT_TASKS[t]
        m, seed = ModelConfig(path=str(base or model_path)), 0
    path = str(model_path) if model_path is not None else m.path
    try:
        model, tok = load_model(path, task, m.num_labels, seed=seed, dtype=m.dtype,
                                quantize=m.quantize, double_quant=m.double_quant,
                                add_tokens=m.add_tokens, add_special_tokens=m.add_special_tokens)
    except RankwiseError as err:
        if model_path is not None or "not found" not in str(err):
            raise
        raise base_moved(err) from None
    return model, tok, m, path


def collect_pairs(model: torch.nn.Module, names: list[str],
                  labels: list[str]) -> dict[str, list[Pair | None]]:
    """``{layer path: [Pair or None per input]}`` in model order, through the protocol's factors.

    Raises:
        RankwiseError: If an input has a layer that is not a plain LoRA pair (DoRA named as such).
    """
    out: dict[str, list[Pair | None]] = {}
    for path, mod in adapter_modules(model):
        row: list[Pair | None] = []
        for name, label in zip(names, labels):
            if name not in mod.adapter_names():
                row.append(None)
                continue
            # the whole delta on the original base: rank 2r [B, -B0][A; A0] for a PiSSA/OLoRA/CorDA init
            whole = getattr(mod, "delta_factors", None)
            ab, info = (whole(name) if whole else factors(mod, name)), describe(mod, name)
            if info.get("use_dora"):
                raise RankwiseError(DORA.format(label=label, path=path))
            if ab is None or "scale" not in info:
                raise RankwiseError(f"{label} adapts {path!r} with {type(mod).__name__}, not a plain "
                                    "LoRA pair (delta = s B A); merge combines LoRA adapters only")
            row.append(Pair(ab[0].detach().float(), ab[1].detach().float(), float(info["scale"])))
        if any(p is not None for p in row):
            out[path] = row
    return out


def merged_rank(pairs: dict[str, list[Pair | None]], rule: MergeRule, labels: list[str]) -> int:
    """The new adapter's rank (PEFT's rule); refuses unequal ranks under the factor-wise rules."""
    ranks = [max((row[i].rank for row in pairs.values() if row[i] is not None), default=0)
             for i in range(len(labels))]
    for i, label in enumerate(labels):
        if not ranks[i]:
            raise RankwiseError(f"{label} holds no LoRA layer; merge combines LoRA adapters")
    if rule.factorwise:
        every = sorted({p.rank for row in pairs.values() for p in row if p is not None})
        if len(every) > 1:
            raise RankwiseError(f"--method {rule.config.name} needs adapters of one rank, "
                                f"got ranks {every}; use --method cat or svd for different ranks")
    return rule.rank(ranks)


def _check_inputs(paths: list[Path], cfg: MergeConfig, out: Path, model_path: Path | None) -> tuple:
    """The settings, an empty ``out`` of kind merge and inputs of one base; ``(out, sources)``."""
    if not paths:
        raise RankwiseError("merge needs at least one adapter (run folders or PEFT folders)")
    problems = configs.problems_of(cfg) + cfg.input_problems(len(paths))
    if problems:
        raise RankwiseError("; ".join(problems))
    out = atomic.check_folder(out)
    folders.check_kind(out, "merge", "merge writes only into a new or empty folder: choose another --out")
    if folders.entries(out):
        raise RankwiseError(f"--out {out} already holds {folders.WHAT['merge']}; choose a new --out "
                            "or delete it first")
    sources = [_source(Path(p)) for p in paths]
    check_same_base(sources, model_path)
    if sum(1 for s in sources if _has_heads(s)) > 1:
        raise RankwiseError("more than one input trained whole modules (a task head); those "
                            "cannot be merged (PEFT refuses too): merge adapters of which at most "
                            "one did")
    return out, sources


def _load_inputs(model, sources: list, names: list[str]) -> list[str]:
    """Load every input as its own adapter; the whole modules (task heads) one of them trained."""
    heads: list[str] = []
    for s, name in zip(sources, names):
        if s.kind == "peft":  # the format's registered loader (the LoRA package's)
            registry.get("exporter", "peft").loader(model, s.path, name)
        else:
            load_adapter(model, s.path, name)
        heads = heads or modules_to_save(model)  # the next load resets the list, not the weights
    return heads


def _write_merge(out: Path, model, tok, m, record: dict, merged: bool) -> None:
    """Write the PEFT folder, the record and (with ``merged``) the folded model, atomically."""
    with atomic.folder(out) as tmp:
        registry.get("exporter", "peft").builder(model, tmp / "peft", adapter_name=MERGED,
                                                 base_model_name_or_path=record["base_model"])
        for f in (tmp / "peft").iterdir():
            shutil.move(str(f), str(tmp / f.name))
        (tmp / "peft").rmdir()
        atomic.write_json(tmp / RECORD, record)
        folders.record(tmp, "merge")
        if merged:
            from rankwise.core.merged import export_merged
            dtype = None if m.quantize else torch_dtype(m.dtype)
            export_merged(model, tmp / MERGED, tokenizer=tok, adapter_name=MERGED, dtype=dtype)


def merge_sources(paths: list[Path], cfg: MergeConfig, out: Path, merged: bool = False,
                  model_path: Path | None = None) -> Path:
    """Merge the adapters in ``paths`` into one PEFT LoRA adapter in ``out``.

    Args:
        paths: Run folders, rankwise adapter folders or PEFT LoRA folders of one base model.
        cfg: The rule and its settings (checked here, as from a file).
        out: Target folder; must be missing or empty.
        merged: Also write the base with the combined adapter folded in, ``out/merged``.
        model_path: The base model's folder (instead of what the inputs record).

    Returns:
        The folder written.

    Raises:
        RankwiseError: Bad settings (all reported at once), inputs of different bases, unequal
            ranks under a factor-wise method, non-LoRA inputs, or a non-empty ``out``.
    """
    out, sources = _check_inputs(paths, cfg, out, model_path)
    model, tok, m, base_path = _load_base(sources, model_path)
    names = [f"input{i}" for i in range(len(sources))]
    heads = _load_inputs(model, sources, names)
    labels = [str(p) for p in paths]
    pairs = collect_pairs(model, names, labels)
    # PEFT: one adapter is a linear scaling
    rule = build_rule(LinearConfig() if len(sources) == 1 else cfg.rule)
    rank = merged_rank(pairs, rule, labels)
    path, row = min(pairs.items(), key=lambda kv: _room(kv[1]))
    if rank > _room(row):
        fix = "choose a smaller --rank" if isinstance(rule.config, SVDConfig) else "use --method svd with --rank"
        raise RankwiseError(f"the merged rank {rank} ({rule.config.name}) does not fit layer {path!r}, "
                            f"which takes at most rank {_room(row)}; {fix}")
    gen = torch.Generator().manual_seed(cfg.seed)
    combined = {path: rule.combine(row, cfg.weights, rank, gen) for path, row in pairs.items()}
    for name in names:
        delete_adapter(model, name)
    rebuild(model, {"name": "lora"}, MERGED, {p: {"r": rank, "alpha": float(rank), "use_rslora": False}
                                              for p in combined}, heads)
    mods = dict(model.named_modules())
    with torch.no_grad():
        for path, (a, b) in combined.items():
            fa, fb = factors(mods[path], MERGED)
            fa.copy_(a)
            fb.copy_(b)
    model.eval()
    base_name = str(demo_model_path()) if base_path == "demo" else base_path
    record = {"inputs": labels, **asdict(cfg), "rule": asdict(rule.config), "rank": rank,
              "base_model": base_name, "fingerprint": fingerprint(model)}
    _write_merge(out, model, tok, m, record, merged)
    return out


def _room(row: list[Pair | None]) -> int:
    """The largest rank a layer's adapter can have: min(in, out)."""
    p = next(p for p in row if p is not None)
    return min(p.a.shape[1], p.b.shape[0])


def _has_heads(source: Source) -> bool:
    meta = _json(source.path / (PEFT_CONFIG if source.kind == "peft" else RANKWISE_CONFIG))
    return bool(meta.get("modules_to_save"))


__all__ = ["MergeConfig", "check_same_base", "collect_pairs", "merge_sources", "merged_rank"]
