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
    model's own folder (``config._name_or_path``), as PEFT's ``replace_lora_weights_loftq`` reads
    them: a 4-bit model no longer holds them.

    Raises:
        RankwiseError: If the folder or a tensor is missing.
    """
    from safetensors import safe_open

    folder = Path(str(getattr(getattr(model, "config", None), "_name_or_path", "") or ""))
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise RankwiseError(f"method.init: loftq reads the full-precision weights from the model "
                            f"folder, but {str(folder) or 'the model'} has no *.safetensors; set "
                            "model.path to a local folder")
    wanted = {f"{p}.weight": p for p in paths}
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


def _check_loftq(layers: dict[str, LoraLayer], iters: int) -> None:
    plain = [p for p, m in layers.items() if not layer_weights.is_quantized(m)
             or type(layer_weights.base_layer(m)).__name__ != "Linear4bit"]
    if plain:
        raise RankwiseError(f"method.init: loftq needs a 4-bit base, but {plain[0]!r} is not "
                            "quantized; set model.quantize: nf4")
    if iters != 1:
        raise RankwiseError(f"method.loftq_iter: got {iters}; on a loaded 4-bit base only 1 is "
                            "supported (the base stays the NF4 of W; more alternations would "
                            "re-quantize it)")


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
        RankwiseError: ``loftq`` on a base that is not 4-bit (or with ``loftq_iter`` != 1).
    """
    kind = inits.init_kind(config.init)
    if kind in ("kaiming", "gaussian"):
        return
    if kind == "loftq":
        _check_loftq(layers, config.loftq_iter)
        originals = original_weights(model, list(layers))
    for path, layer in layers.items():
        r, s = layer.ranks[adapter_name], layer.scaling[adapter_name]
        w = layer_weights.dense_weight(layer).detach().float()  # (out, in), as loaded
        if kind == "pissa":
            a, b = inits.pissa(w, r, s, inits.pissa_niter(config.init))
        elif kind == "olora":
            a, b = inits.olora(w, r)
        elif kind == "corda":
            a, b = inits.corda(w, stats[path].covariance().to(w), r, s, config.corda_mode)
        elif kind == "eva":
            a = eva_vectors[path].to(w)
            b = torch.zeros(w.shape[0], r, dtype=w.dtype, device=w.device)
        else:  # loftq, one alternation: Q is the loaded NF4 base, BA the SVD of W - Q
            a, b, _, _, _ = inits.loftq(originals[path].to(w), r, s, 1, quantize=lambda _x: w)
        layer.set_initial(adapter_name, a, b, residual=kind in ("pissa", "olora", "corda"))
