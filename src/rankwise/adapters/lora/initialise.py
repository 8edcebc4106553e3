"""Put ``method.init``'s factors into freshly added LoRA layers (the math is in ``inits.py``).

Called by :func:`rankwise.adapters.lora.apply_lora` after the layers are wrapped; EVA also
decides the ranks before wrapping (:func:`eva_structure`). Nothing here runs when a saved
adapter is rebuilt: its factors (and ``A0, B0``) come from the file.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rankwise.adapters.lora import inits
from rankwise.adapters.lora.calibrate import InputStats
from rankwise.adapters.lora.layer import LoraLayer
from rankwise.core import weights as layer_weights
from rankwise.errors import RankwiseError


def eva_structure(stats: dict[str, InputStats], settings: dict[str, tuple], rho: float,
                  limits: dict[str, int]) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
    """EVA's ranks: a budget of ``sum r`` components shared by explained variance, at most
    ``round(rho * r)`` per layer; alpha scaled by ``r_new / r`` so each layer keeps its scale
    (as PEFT's ``adjust_scaling_factors``).

    Args:
        stats: ``{path: InputStats}`` of the targets.
        settings: ``{path: (r, alpha, use_rslora)}`` before redistribution.
        rho: The cap factor (>= 1).
        limits: ``{path: min(in, out)}``, the largest rank a layer takes.

    Returns:
        ``({path: {"r", "alpha", "use_rslora"}}, {path: V (r_new, in)})``.
    """
    candidates, ratios = {}, {}
    for path, s in stats.items():
        r = settings[path][0]
        cap = min(max(round(rho * r), r), limits[path])
        candidates[path], ratios[path] = inits.eva_components(s.gram, s.mean(), s.count, cap)
    budget = sum(settings[p][0] for p in stats)
    ranks = inits.eva_ranks(ratios, budget)
    structure = {p: {"r": ranks[p], "alpha": settings[p][1] * ranks[p] / settings[p][0],
                     "use_rslora": settings[p][2]} for p in stats}
    return structure, {p: candidates[p][: ranks[p]] for p in stats}


def original_weights(model: nn.Module, paths: list[str]) -> dict[str, torch.Tensor]:
    """The full-precision ``(out, in)`` weights of ``paths`` from the safetensors files of the
    model's own folder (``model.source_folder`` where the loader set it, else
    ``config._name_or_path``), as PEFT's ``replace_lora_weights_loftq`` reads
    them: a 4-bit model no longer holds them.

    Raises:
        RankwiseError: If the folder or a tensor is missing.
    """
    from safetensors import safe_open

    folder = Path(str(getattr(model, "source_folder", None)
                      or getattr(getattr(model, "config", None), "_name_or_path", "") or ""))
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise RankwiseError(f"method.init: loftq reads the full-precision weights from the model "
                            f"folder, but {str(folder) or 'the model'} has no *.safetensors; set "
                            "model.path to a local folder")
    # the checkpoint may name a layer with or without the task model's prefix: a head model's
    # "bert.encoder..." is "encoder..." in a base model's file, and the other way round
    wanted = {f"{p.split('.', 1)[-1]}.weight": p for p in paths} | {f"{p}.weight": p for p in paths}
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                path = wanted.get(key) or wanted.get(key.split(".", 1)[-1])
                if path is not None:
                    out[path] = fh.get_tensor(key).float()
    missing = [p for p in paths if p not in out]
    if missing:
        raise RankwiseError(f"method.init: loftq found no weight for {missing[0]!r} in {folder}")
    return out


def _check_loftq(layers: dict[str, LoraLayer]) -> None:
    plain = [p for p, m in layers.items() if not layer_weights.is_quantized(m)
             or type(layer_weights.base_layer(m)).__name__ != "Linear4bit"]
    if plain:
        raise RankwiseError(f"method.init: loftq needs a 4-bit base, but {plain[0]!r} is not "
                            "quantized; set model.quantize: nf4")


def _quantizer(base: nn.Module):
    """``(roundtrip, store)`` for a bitsandbytes ``Linear4bit``: dequantize(quantize(x)) and
    "put quantize(x) into the layer", both with the layer's own settings (block size, NF4/FP4,
    double quantization, storage dtype), so the codes are those transformers would write."""
    import bitsandbytes.functional as bnbf
    p = base.weight
    kw = {"blocksize": p.blocksize, "compress_statistics": p.compress_statistics,
          "quant_type": p.quant_type, "quant_storage": p.quant_storage}

    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        packed, state = bnbf.quantize_4bit(x.to(p.device).contiguous(), **kw)
        return bnbf.dequantize_4bit(packed, state).float()

    def store(x: torch.Tensor) -> None:
        packed, state = bnbf.quantize_4bit(x.to(p.device).contiguous(), **kw)
        p.data, p.quant_state = packed, state

    return roundtrip, store


def loftq_layers(model: nn.Module, layers: dict[str, LoraLayer], adapter_name: str, iters: int,
                 set_factors: bool = True) -> None:
    """LoftQ on 4-bit layers (Li et al. 2023, Alg. 1) from the full-precision weights on disk.

    The first alternation quantizes ``W`` itself: its ``Q`` is the base as loaded, which is then
    kept (``iters == 1``: only A, B change). Later ones re-quantize the base to
    ``NF4(W - s B_{T-1} A_{T-1})`` in the layer's own format; that is deterministic in ``W``, so
    a rebuild (``set_factors=False``: resume, reload) recomputes the same base while the
    factors come from the file.

    Raises:
        RankwiseError: If a layer is not 4-bit, or the weights are not on disk.
    """
    _check_loftq(layers)
    originals = original_weights(model, list(layers))
    for path, layer in layers.items():
        base = layer_weights.base_layer(layer)
        loaded = layer_weights.dense_weight(layer).detach().float()
        roundtrip, store = _quantizer(base)
        calls = iter(range(iters))
        quantize = lambda x: loaded if next(calls) == 0 else roundtrip(x)  # noqa: E731
        w = originals[path].to(loaded.device)
        r, s = layer.ranks[adapter_name], layer.scaling[adapter_name]
        a, b, _, a_prev, b_prev = inits.loftq(w, r, s, iters, quantize)
        if iters > 1:
            store(w - s * b_prev @ a_prev)
            layer.requantized.add(adapter_name)
        if set_factors:
            layer.set_initial(adapter_name, a, b, residual=False)


def initialise(model: nn.Module, layers: dict[str, LoraLayer], config, adapter_name: str,
               stats: dict[str, InputStats] | None = None,
               eva_vectors: dict[str, torch.Tensor] | None = None) -> None:
    """Set every layer's factors by ``config.init`` (``kaiming``/``gaussian`` were set by
    ``LoraLayer.add``).

    Args:
        model: The adapted model.
        layers: ``{path: LoraLayer}`` just added.
        config: The :class:`~rankwise.adapters.lora.LoraConfig`.
        adapter_name: The adapter.
        stats: Input statistics (``corda``).
        eva_vectors: ``{path: V (r, in)}`` (``eva``).

    Raises:
        RankwiseError: ``loftq`` on a base that is not 4-bit.
    """
    kind = inits.init_kind(config.init)
    if kind in ("kaiming", "gaussian"):
        return
    if kind == "loftq":
        loftq_layers(model, layers, adapter_name, config.loftq_iter)
        return
    for path, layer in layers.items():
        r, s = layer.ranks[adapter_name], layer.scaling[adapter_name]
        w = layer_weights.dense_weight(layer).detach().float()  # (out, in), as loaded
        if kind == "pissa":
            a, b = inits.pissa(w, r, s, inits.pissa_niter(config.init))
        elif kind == "olora":
            a, b = inits.olora(w, r)
        elif kind == "corda":
            a, b = inits.corda(w, stats[path].covariance().to(w), r, s, config.corda_mode)
        else:  # eva
            a = eva_vectors[path].to(w)
            b = torch.zeros(w.shape[0], r, dtype=w.dtype, device=w.device)
        layer.set_initial(adapter_name, a, b, residual=kind in ("pissa", "olora", "corda"))
