"""HF PEFT's LoRA file format, out and in: ``adapter_config.json`` + ``adapter_model.safetensors``.

What PEFT expects on disk (checked against peft 0.21 by saving real ``PeftModel`` objects):

* tensor keys ``base_model.model.<module path>.lora_A.weight`` (shape (r, in)) and
  ``...lora_B.weight`` (shape (out, r)); the adapter name is not part of the key; GPT-2's
  ``Conv1D`` uses the same shapes and ``fan_in_fan_out: true`` in the config;
* DoRA's magnitude (``use_dora: true``) as ``...lora_magnitude_vector`` (shape (out,), no
  ``.weight`` suffix);
* whole trained modules (``modules_to_save``) as ``base_model.model.<path>.<param>``;
* one global ``r`` / ``lora_alpha`` / ``use_rslora``, with per-layer exceptions in
  ``rank_pattern`` / ``alpha_pattern`` (a key matches a path by ``(.*\\.)?(key)$``).
* LoRA on fused 3-D expert parameters as ``target_parameters`` (its key layout is in
  :mod:`rankwise.adapters.lora.peft_experts`).

rankwise never imports ``peft``: this module only writes and reads those two files.
"""
from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from rankwise.adapters.common.experts import ExpertLoraLayer
from rankwise.adapters.common.peft import CONFIG, WEIGHTS, peft_task_type, token_rows, write_peft_folder
from rankwise.adapters.lora.config import LoraConfig
from rankwise.adapters.lora.layer import LoraLayer
from rankwise.core.inject import is_linear_like, is_wrapped, matches
from rankwise.core.ops import load_adapter_state_dict, mark_trainable, modules_to_save
from rankwise.core.protocol import adapter_modules, is_mergeable
from rankwise.core.tokens import TokenHeadRows, TokenRows

TOKEN_LAYERS = (TokenRows, TokenHeadRows)
from rankwise.errors import RankwiseError

PICKLE_WEIGHTS = "adapter_model.bin"
PREFIX = "base_model.model."

# transformers class-name suffix -> PEFT task_type

# PEFT config keys rankwise understands or can safely ignore at these values. A key whose
# value differs from every listed neutral value is an unsupported feature (RankwiseError).
_NEUTRAL: dict[str, tuple] = {
    "lora_bias": (False, None), "bias": ("none", None),
    "layers_to_transform": (None,), "layers_pattern": (None, [], ""), "layer_replication": (None,),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None,), "arrow_config": (None,), "megatron_config": (None,),
    "use_bdlora": (None, False), "modules_to_tie": (None, []),
}
# Keys read by load_peft, and keys that only describe training or provenance.
_USED = {"peft_type", "r", "lora_alpha", "trainable_token_indices", "use_rslora", "use_dora",
         "rank_pattern", "alpha_pattern",
         "lora_dropout", "target_modules", "modules_to_save", "fan_in_fan_out", "task_type",
         "base_model_name_or_path", "target_parameters"}
_HARMLESS = {"inference_mode", "init_lora_weights", "revision", "peft_version", "auto_mapping",
             "exclude_modules", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
             "kasa_config", "velora_config", "monteclora_config", "megatron_core",
             "qalora_group_size", "ensure_weight_tying"}


def _lora_layers(model: nn.Module, adapter_name: str) -> dict[str, Any]:
    kinds = (LoraLayer, ExpertLoraLayer)  # linear layers and fused expert parameters
    layers = {p: m for p, m in adapter_modules(model)
              if isinstance(m, kinds) and adapter_name in m.adapter_names()}
    others = [(p, m) for p, m in adapter_modules(model)  # trainable token rows: token_rows()
              if not isinstance(m, (*kinds, *TOKEN_LAYERS)) and adapter_name in m.adapter_names()]
    if others:
        # suggest only what works: a merged export refuses layers that cannot merge
        merged = " or --format merged" if all(is_mergeable(m) for _, m in others) else ""
        raise RankwiseError(f"adapter {adapter_name!r} has non-LoRA layers (e.g. {others[0][0]!r}, "
                            f"{type(others[0][1]).__name__}); the PEFT LoRA format holds LoRA only: "
                            f"export with --format rankwise{merged}")
    if not layers:
        names = sorted({n for _, m in adapter_modules(model) for n in m.adapter_names()})
        fix = "pass one of those names" if names else "export with --format merged instead"
        raise RankwiseError(f"no LoRA adapter named {adapter_name!r} in the model (adapters "
                            f"here: {names}); {fix}")
    return layers


def _target_modules(model: nn.Module, paths: list[str]) -> list[str]:
    """Short suffixes when they select exactly ``paths`` (as PEFT will match them), else paths."""
    suffixes = sorted({p.rsplit(".", 1)[-1] for p in paths})
    wrapped = [p for p, _ in adapter_modules(model)]
    hit = [p for p, m in model.named_modules()
           if p and (is_linear_like(m) or is_wrapped(m))
           and any(matches(p, s) for s in suffixes)
           and not any(p.startswith(q + ".") for q in wrapped)]
    return suffixes if sorted(hit) == sorted(paths) else sorted(paths)


def _check_dora_base(layers: dict[str, Any], dora: dict[str, bool], adapter_name: str) -> None:
    """Refuse DoRA on a bitsandbytes 4-bit base: PEFT evaluates it with another weight norm.

    On a CPU with AVX512-BF16 bitsandbytes repacks a 4-bit weight for its inference kernel at
    the first eval forward, and PEFT's DoRA then takes ``||W + s B A||`` from
    ``dequantize_4bit`` of the repacked bytes read as the standard layout (scrambled weights;
    ``peft.utils.integrations.dequantize_bnb_weight``): PEFT's model is another model than the
    one rankwise trained and its merged export holds (docs/dora.md). Plain LoRA reads no
    weight, and DoRA on a dense or 8-bit base dequantizes no repacked layout.

    Raises:
        RankwiseError: Naming a 4-bit DoRA layer, the reason and the exports that keep it.
    """
    from rankwise.core.quant import is_4bit
    four = [p for p, m in layers.items() if dora.get(p) and is_4bit(m.base_layer)]
    if four:
        raise RankwiseError(
            f"adapter {adapter_name!r} is DoRA on a bitsandbytes 4-bit base (e.g. {four[0]!r}), "
            "which PEFT evaluates differently: in an eval forward on a CPU with AVX512-BF16, "
            "bitsandbytes repacks the 4-bit weight and PEFT's DoRA takes its weight norm from the "
            "repacked bytes; export with --format merged (the adapter folded into the dequantized "
            "base) or --format rankwise, or, for PEFT on a GPU or in training mode only, "
            "export_peft(..., allow_4bit_dora=True)")


def _pattern_key(path: str, names: list[str]) -> str:
    """The ``rank_pattern`` / ``alpha_pattern`` key of module ``path``: the path without its first
    component, escaped, where that still selects ``path`` alone among ``names``; else the path.

    peft 0.13 matches a key by ``re.match(rf".*\\.{key}$", path)`` (a dot before the key), later
    versions by ``(.*\\.)?{key}$``; a full path from the model's root (``model.layers.0...``)
    matches only the second, and peft 0.13 would build that layer with the global rank.
    """
    rest = path.partition(".")[2]
    if rest and sum(n == rest or n.endswith("." + rest) for n in names) == 1:
        return re.escape(rest)
    return re.escape(path)


def _check_exportable(layers: dict[str, Any], adapter_name: str, allow_4bit_dora: bool) -> dict[str, bool]:
    """Refuse what a PEFT LoRA file cannot hold; return ``{path: is DoRA}``."""
    requantized = [p for p, m in layers.items() if adapter_name in m.requantized]
    if requantized:
        raise RankwiseError(f"adapter {adapter_name!r} was trained on a base that LoftQ re-quantized "
                            f"(method.loftq_iter > 1, e.g. {requantized[0]!r}), which a PEFT LoRA "
                            "adapter on the original base cannot express: export with --format "
                            "merged (or train with loftq_iter: 1)")
    dora = {p: m.is_dora(adapter_name) for p, m in layers.items()}
    if len(set(dora.values())) > 1:
        plain = next(p for p, d in dora.items() if not d)
        raise RankwiseError(f"adapter {adapter_name!r} mixes DoRA and plain LoRA layers (e.g. "
                            f"{plain!r} is plain); PEFT's use_dora is one flag for every layer: "
                            "export with --format rankwise or --format merged")
    if not allow_4bit_dora:
        _check_dora_base(layers, dora, adapter_name)
    return dora


def _layer_tensors(layers: dict[str, Any], adapter_name: str,
                   tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Add each layer's PEFT tensors to ``tensors``; return ``{path: (r, alpha, use_rslora)}``."""
    settings = {p: (m.ranks[adapter_name], float(m.alphas[adapter_name]),
                    bool(m.rslora.get(adapter_name, False))) for p, m in layers.items()}
    for path, layer in layers.items():
        a, b = (t.cpu() for t in layer.delta_factors(adapter_name))
        if a.shape[0] != settings[path][0]:  # residual init: s [B, -B0] [A; A0], rank 2r, same s
            r, alpha, rs = settings[path]
            scale = layer.scaling[adapter_name]
            settings[path] = (2 * r, scale * (2 * r) ** 0.5 if rs else scale * 2 * r, rs)
        tensors[f"{PREFIX}{path}.lora_A.weight"] = a.contiguous()
        tensors[f"{PREFIX}{path}.lora_B.weight"] = b.contiguous()
        for key, p in layer.adapter_params(adapter_name).items():  # DoRA's magnitude
            if key not in ("lora_A.weight", "lora_B.weight"):
                tensors[f"{PREFIX}{path}.{key}"] = p.detach().cpu().contiguous()
    return settings


def _global_settings(settings: dict[str, tuple], keys: dict[str, str]) -> dict[str, Any]:
    """PEFT's global ``r``/``lora_alpha``/``use_rslora`` (most common) and per-path patterns
    (``keys``: each path's pattern key, :func:`_pattern_key`).

    Rewrites ``settings`` in place to the global rsLoRA flag (alpha giving the same scale)."""
    rslora = Counter(s[2] for s in settings.values()).most_common(1)[0][0]
    for p, (r, alpha, rs) in settings.items():  # same scale under the global rsLoRA flag
        if rs != rslora:
            alpha = alpha * r ** 0.5 if rs else alpha / r ** 0.5
            settings[p] = (r, alpha, rslora)
    r0 = Counter(s[0] for s in settings.values()).most_common(1)[0][0]
    a0 = Counter(s[1] for s in settings.values()).most_common(1)[0][0]
    rank_pattern = {keys[p]: r for p, (r, _, _) in settings.items() if r != r0}
    alpha_pattern = {keys[p]: a for p, (_, a, _) in settings.items() if a != a0}
    return {"r": r0, "lora_alpha": a0, "use_rslora": rslora,
            "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}


def export_peft(model: nn.Module, out_dir: str | Path, adapter_name: str = "default",
                task_type: str | None = None, base_model_name_or_path: str | None = None,
                allow_4bit_dora: bool = False) -> Path:
    """Write LoRA adapter ``adapter_name`` in HF PEFT's format (atomically).

    Per-layer settings become PEFT's single global ``r``/``lora_alpha``/``use_rslora`` (the
    most common values) plus ``rank_pattern``/``alpha_pattern`` entries keyed by the escaped
    module path less its first component (:func:`_pattern_key`). A layer whose rsLoRA flag differs from the global one gets the alpha
    that gives the same scale (alpha' = alpha * sqrt(r) or alpha / sqrt(r)), so PEFT computes
    exactly rankwise's scale. A layer initialised with PiSSA, OLoRA or CorDA (frozen ``A0, B0``)
    is written as PEFT's ``path_initial_model_for_weight_conversion`` does: the rank-2r pair
    ``[A; A0]``, ``[B, -B0]`` with alpha giving the same scale, which applies to the original base.

    Args:
        model: A model with rankwise LoRA layers holding ``adapter_name``.
        out_dir: Target folder (replaced only when writing succeeded).
        adapter_name: The adapter to export.
        task_type: PEFT task type; inferred from the model class (``SEQ_CLS``, ``CAUSAL_LM``,
            ...) when None.
        base_model_name_or_path: Recorded in the config; defaults to the model config's
            ``_name_or_path``.
        allow_4bit_dora: Write DoRA on a bitsandbytes 4-bit base anyway, for a PEFT that runs
            it where bitsandbytes does not repack the weight (CUDA, or training mode).

    Returns:
        The folder written.

    Raises:
        RankwiseError: If the adapter is missing, has layers that are not LoRA, mixes DoRA
            and plain LoRA layers (PEFT's ``use_dora`` is one flag for all), was trained on
            a base that LoftQ re-quantized, or is DoRA on a 4-bit base (see
            :func:`_check_dora_base`) without ``allow_4bit_dora``.
    """
    from rankwise.adapters.lora.peft_experts import expert_export, target_parameter_names
    layers = _lora_layers(model, adapter_name)
    experts = {p: m for p, m in layers.items() if isinstance(m, ExpertLoraLayer)}
    layers = {p: m for p, m in layers.items() if p not in experts}
    dora = _check_exportable(layers, adapter_name, allow_4bit_dora)
    expert_settings, expert_tensors = expert_export(experts, adapter_name, PREFIX)
    tensors: dict[str, torch.Tensor] = dict(expert_tensors)
    settings = _layer_tensors(layers, adapter_name, tensors)
    settings.update(expert_settings)  # keyed by the parameter's full name, as PEFT matches
    names = [n for n, _ in model.named_modules()]
    keys = {p: _pattern_key(p, names) if p in layers else re.escape(p) for p in settings}
    global_settings = _global_settings(settings, keys)
    first = next(iter(layers.values()), None)
    drop = first.lora_dropout[adapter_name] if first is not None else None
    saved = modules_to_save(model)
    cfg_name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    config = {
        "peft_type": "LORA", "task_type": task_type or peft_task_type(model),
        "base_model_name_or_path": base_model_name_or_path or cfg_name,
        **global_settings,  # r, lora_alpha, use_rslora, rank_pattern, alpha_pattern
        "target_modules": _target_modules(model, list(layers)),
        "lora_dropout": float(getattr(drop, "p", 0.0)),
        "fan_in_fan_out": any(m.fan_in_fan_out for m in layers.values()),
        "modules_to_save": saved or None, "bias": "none",
        "use_dora": any(dora.values()),
        "init_lora_weights": True, "inference_mode": True,
    }
    if experts:
        config["target_parameters"] = target_parameter_names(model, list(expert_settings))
    indices, token_tensors = token_rows(model, adapter_name, PREFIX)  # method.trainable_tokens
    if indices is not None:
        config["trainable_token_indices"] = indices
    tensors.update(token_tensors)
    return write_peft_folder(out_dir, config, tensors, model, saved, PREFIX)


def read_peft_config(peft_dir: str | Path) -> dict[str, Any]:
    """Read and check a PEFT ``adapter_config.json``.

    Args:
        peft_dir: A folder written by ``PeftModel.save_pretrained`` or :func:`export_peft`.

    Returns:
        The config dict.

    Raises:
        RankwiseError: If the file is missing or corrupt, or it uses a feature rankwise
            cannot load (LoRA bias, a non-LoRA ``peft_type``, ...). Unknown keys only
            warn.
    """
    path = Path(peft_dir) / CONFIG
    if not path.is_file():
        raise RankwiseError(f"{peft_dir} is not a PEFT adapter folder: {CONFIG} is missing")
    try:
        cfg = json.loads(path.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (ValueError, OSError) as err:
        raise RankwiseError(f"{path} is corrupt ({err}); re-save the adapter with PEFT") from None
    if cfg.get("peft_type") != "LORA":
        raise RankwiseError(f"{path}: peft_type is {cfg.get('peft_type')!r}; rankwise imports "
                            "LoRA adapters only (expected 'LORA')")
    bad = [f"{k}={cfg[k]!r}" for k, ok in _NEUTRAL.items() if k in cfg and cfg[k] not in ok]
    if bad:
        raise RankwiseError(f"{path} uses PEFT features rankwise does not support: "
                            f"{', '.join(bad)}; merge it with PEFT and load the merged model")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init not in ("gaussian", "eva", "orthogonal"):
        warnings.warn(f"{path}: init_lora_weights={init!r} changes the base weights in PEFT; unless "
                      "the adapter was saved with path_initial_model_for_weight_conversion, it "
                      "only reproduces its outputs on that modified base model", stacklevel=2)
    unknown = sorted(set(cfg) - _USED - _HARMLESS - set(_NEUTRAL))
    if unknown:
        warnings.warn(f"{path}: ignoring PEFT config keys rankwise does not know: {unknown}",
                      stacklevel=2)
    return cfg


def _read_tensors(peft_dir: Path) -> dict[str, torch.Tensor]:
    weights = peft_dir / WEIGHTS
    if not weights.is_file():
        if (peft_dir / PICKLE_WEIGHTS).is_file():
            raise RankwiseError(
                f"{peft_dir} holds {PICKLE_WEIGHTS} (a pickle, which rankwise never loads); "
                "re-save it with PEFT as model.save_pretrained(dir, safe_serialization=True)")
        raise RankwiseError(f"{weights} is missing; re-save the adapter with PEFT")
    try:
        return load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        raise RankwiseError(f"{weights} is corrupt ({err}); re-save the adapter with PEFT") from None


def _split(tensors: dict[str, torch.Tensor], model: nn.Module):
    """Split file tensors into ``{layer path: {A, B[, magnitude]}}`` and ``{model param: tensor}``."""
    lora: dict[str, dict[str, torch.Tensor]] = {}
    rest: dict[str, torch.Tensor] = {}
    tokens: dict[str, torch.Tensor] = {}  # trainable_token_indices rows by module path
    for key, value in tensors.items():
        if not key.startswith(PREFIX):
            raise RankwiseError(f"PEFT tensor key {key!r} does not start with {PREFIX!r}; "
                                "re-save the adapter with PEFT")
        key = key[len(PREFIX):]
        m = (re.fullmatch(r"(.+)\.(lora_[AB])\.weight", key)
             or re.fullmatch(r"(.+)\.(lora_magnitude_vector)", key))
        t = re.fullmatch(r"(.+)\.token_adapter\.trainable_tokens_delta", key)
        if m:
            lora.setdefault(m[1], {})[m[2]] = value
        elif t:
            tokens[t[1]] = value
        elif "lora_" in key:
            raise RankwiseError(f"PEFT tensor {key!r} is not a LoRA linear weight (embedding or "
                                "bias adapters are unsupported); merge it with PEFT instead")
        else:
            rest[key] = value
    modules = dict(model.named_modules())
    missing = [p for p in [*lora, *tokens] if p not in modules]
    if missing:
        raise RankwiseError(f"PEFT adapter targets {missing[0]!r}, which this model lacks; load "
                            "it onto the base model it was trained on")
    return lora, rest, tokens


def _load_token_rows(model: nn.Module, cfg: dict, rows: dict[str, torch.Tensor],
                     adapter_name: str) -> dict[str, torch.Tensor]:
    """Add the trainable-token layers of ``trainable_token_indices`` and return their deltas
    (PEFT stores the rows' values ``W[ids] + Δ``) as adapter state keys."""
    from rankwise.core.tokens import add_trainable_tokens
    indices = cfg.get("trainable_token_indices")
    if not indices:
        return {}
    lists = list(indices.values()) if isinstance(indices, dict) else [indices]
    if any(sorted(x) != sorted(lists[0]) for x in lists) or len(rows) != len(lists):
        raise RankwiseError(f"trainable_token_indices {indices!r}: rankwise loads the same token ids "
                            "on the embedding and the head only; merge it with PEFT instead")
    emb = next(p for p, m in model.named_modules() if m is model.get_input_embeddings())
    if emb not in rows:
        raise RankwiseError(f"trainable_token_indices train {sorted(rows)}, not the input embedding "
                            f"{emb!r}; merge it with PEFT instead")
    ids = [int(i) for i in lists[0]]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    layers = add_trainable_tokens(model, ids, adapter_name, head=tied or len(rows) > 1)  # as PEFT ties
    if sorted(p for p, m in layers.items() if m.adapter_params(adapter_name)) != sorted(rows):
        raise RankwiseError(f"trainable_token_indices train {sorted(rows)}, which is not this model's "
                            "embedding and (untied) head; load it onto the base it was trained on")
    state = {}
    for path, values in rows.items():
        w = layers[path].weight
        rows = w[torch.tensor(ids, device=w.device)].detach().float().cpu()
        state[f"{path}.token_delta"] = values.float() - rows
    return state


def load_peft(model: nn.Module, peft_dir: str | Path, adapter_name: str = "default",
              check: bool = True) -> dict:
    """Import a PEFT-saved LoRA adapter into rankwise LoRA layers (in place).

    Ranks come from the tensors' shapes; alpha from ``alpha_pattern`` / ``lora_alpha`` with
    PEFT's matching rule; whole modules (``modules_to_save``) are copied into the model's
    own modules, which then train and save with the adapter. Pairs on fused 3-D expert
    parameters (``target_parameters``) become :class:`ExpertLoraLayer` pairs.

    Args:
        model: The base model the adapter was trained on (no adapter named ``adapter_name``).
        peft_dir: A folder with ``adapter_config.json`` + ``adapter_model.safetensors``.
        adapter_name: The name to give the adapter in rankwise.
        check: Run one probe batch with and without the adapter and refuse an adapter whose
            non-zero weights do not change the output (:func:`rankwise.core.probe.check_effect`).

    Returns:
        The PEFT config dict.

    Raises:
        RankwiseError: On a missing/corrupt/pickled file, unsupported features, an adapter
            that does not fit the model, or one that loads and does nothing (``check``).
    """
    from rankwise.adapters.lora.apply import apply_lora, pattern_value

    from rankwise.adapters.lora.peft_experts import take_expert_tensors
    peft_dir = Path(peft_dir)
    cfg = read_peft_config(peft_dir)
    tensors = _read_tensors(peft_dir)
    experts, expert_state = {}, {}
    if cfg.get("target_parameters"):  # fused 3-D expert parameters
        experts, expert_state, tensors = take_expert_tensors(tensors, model, cfg, PREFIX)
    lora, rest, token_values = _split(tensors, model)
    if not lora and not experts:
        raise RankwiseError(f"{peft_dir / WEIGHTS} holds no LoRA tensors; re-save the adapter")
    rslora, use_dora = bool(cfg.get("use_rslora", False)), bool(cfg.get("use_dora", False))
    expected = {"lora_A", "lora_B"} | ({"lora_magnitude_vector"} if use_dora else set())
    structure = {}
    for path, ab in lora.items():
        if set(ab) != expected:
            raise RankwiseError(f"PEFT adapter has {sorted(ab)} for {path!r} where use_dora="
                                f"{use_dora} needs {sorted(expected)}; re-save it with PEFT")
        alpha = pattern_value(path, cfg.get("alpha_pattern") or {}, cfg.get("lora_alpha", 8))
        structure[path] = {"r": int(ab["lora_A"].shape[0]), "alpha": float(alpha),
                           "use_rslora": rslora, "use_dora": use_dora}
    params = dict(model.named_parameters())
    unknown = [k for k in rest if k not in params]
    if unknown:
        raise RankwiseError(f"PEFT adapter holds {unknown[0]!r}, which this model lacks; load it "
                            "onto the base model it was trained on")
    names = cfg.get("modules_to_save") or []
    saved = sorted({p for p, _ in model.named_modules() if p and any(matches(p, n) for n in names)
                    and any(k.startswith(p + ".") for k in rest)})
    structure.update(experts)
    params = [f"{p}.{n}" for p, s in experts.items() for n in s["parameters"]]
    config = LoraConfig(targets=list(lora), dropout=float(cfg.get("lora_dropout") or 0.0),
                        modules_to_save=saved, target_parameters=params)
    apply_lora(model, config, adapter_name, structure=structure)
    state = {f"{p}.{k}" if k == "lora_magnitude_vector" else f"{p}.{k}.weight": v
             for p, ab in lora.items() for k, v in ab.items()}
    state.update(rest)
    state.update(expert_state)
    state.update(_load_token_rows(model, cfg, token_values, adapter_name))
    mark_trainable(model, adapter_name)
    load_adapter_state_dict(model, state, adapter_name)
    if check:
        from rankwise.core.probe import check_effect
        check_effect(model, adapter_name)
    return cfg


def loaded_lora_config(model: nn.Module, peft_cfg: dict[str, Any], adapter_name: str = "default") -> LoraConfig:
    """The ``lora`` method config of the PEFT adapter :func:`load_peft` just put on ``model``:
    its adapted paths, the global ``r`` / ``lora_alpha`` / rsLoRA / DoRA / dropout of
    ``peft_cfg`` (per-layer ranks stay in the layers' ``describe``) and its whole modules.

    Args:
        model: The model :func:`load_peft` loaded into.
        peft_cfg: What :func:`load_peft` returned (the ``adapter_config.json`` dict).
        adapter_name: The name it was loaded as.

    Returns:
        The config (``rankwise train`` records it as the run's ``method`` section).
    """
    from rankwise.configs import from_dict
    from rankwise.core.protocol import describe
    layers = {p: describe(m, adapter_name) for p, m in adapter_modules(model)
              if adapter_name in m.adapter_names() and isinstance(m, (LoraLayer, ExpertLoraLayer))}
    modules = [p for p, d in layers.items() if "parameters" not in d]
    params = [f"{p}.{n}" for p, d in layers.items() for n in d.get("parameters", [])]
    return from_dict(LoraConfig, {
        "targets": modules, "target_parameters": params, "r": int(peft_cfg.get("r", 8)),
        "alpha": float(peft_cfg.get("lora_alpha", 8)), "dropout": float(peft_cfg.get("lora_dropout") or 0.0),
        "use_rslora": bool(peft_cfg.get("use_rslora", False)), "use_dora": bool(peft_cfg.get("use_dora", False)),
        "modules_to_save": modules_to_save(model) or None}, "method")
