"""PEFT's file layout of LoRA on fused 3-D expert parameters (``target_parameters``), out and in.

What peft 0.21 writes for a ``ParamWrapper`` (checked by saving real ``PeftModel`` objects on a
tiny Qwen3-MoE):

* one wrapper per targeted parameter; several on one module nest, the parameter registered
  first innermost, so the pair of the i-th of k targeted parameters (registration order) sits
  at ``<module path>`` + ``.base_layer`` * (k - 1 - i);
* ``lora_A.weight`` of shape ``(E*r, in)``: expert-major rows, ``A_peft[e*r + j] = A_e[j]``;
* ``lora_B.weight`` of shape ``(out, r*E)``: expert-*minor* columns,
  ``B_peft[:, j*E + e] = B_e[:, j]`` (PEFT reshapes it ``(out, r, E)``);
* ``in``/``out`` as the expert's ``W_e (out, in)``, for ``(E, in, out)`` storage too;
* ``rank_pattern`` / ``alpha_pattern`` keys match the parameter's full name
  (``model.layers.0.mlp.experts.gate_up_proj``); ``target_parameters`` lists names or suffixes.

rankwise keeps ``A (E, r, in)`` and ``B (E, out, r)`` (see
:mod:`rankwise.adapters.common.experts`); this module only reorders them.
"""
from __future__ import annotations

import torch
from torch import nn

from rankwise.adapters.common.experts import ExpertLoraLayer
from rankwise.core.inject import find_parameter_targets
from rankwise.errors import RankwiseError


def ordered(layer: ExpertLoraLayer, names) -> list[str]:
    """``names`` in the order the base module registered its parameters (PEFT's nesting)."""
    order = [n for n, _ in layer.base_layer.named_parameters(recurse=False)]
    return sorted(names, key=order.index)


def peft_prefixes(path: str, layer: ExpertLoraLayer, adapter_name: str) -> dict[str, str]:
    """``{parameter: PEFT module path of its pair}`` for the parameters adapter
    ``adapter_name`` adapts on ``layer`` (at ``path``)."""
    names = ordered(layer, layer.lora_A[adapter_name])
    k = len(names)
    return {n: path + ".base_layer" * (k - 1 - i) for i, n in enumerate(names)}


def to_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``A (E, r, in)``, ``B (E, out, r)`` -> PEFT's ``(E*r, in)``, ``(out, r*E)``."""
    experts, r, n_in = a.shape
    n_out = b.shape[1]
    return a.reshape(experts * r, n_in), b.permute(1, 2, 0).reshape(n_out, r * experts)


def from_peft(a: torch.Tensor, b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ``(E*r, in)``, ``(out, r*E)`` -> ``A (E, r, in)``, ``B (E, out, r)``."""
    r = a.shape[0] // experts
    return a.reshape(experts, r, a.shape[1]), b.reshape(b.shape[0], r, experts).permute(2, 0, 1)


def target_parameter_names(model: nn.Module, keys: list[str]) -> list[str]:
    """Short suffixes (``mlp.experts.gate_up_proj``) when they select exactly the parameters
    ``keys`` (full names) among the model's 3-D parameters, else the full names."""
    short = sorted({".".join(k.split(".")[-3:]) for k in keys})
    try:
        hit = find_parameter_targets(model, short)
    except RankwiseError:
        return sorted(keys)
    got = sorted(f"{p}.{n}" for p, names in hit.items() for n in names)
    return short if got == sorted(keys) else sorted(keys)


def expert_export(layers: dict[str, ExpertLoraLayer], adapter_name: str, prefix: str):
    """The expert pairs of adapter ``adapter_name`` as PEFT writes them.

    Args:
        layers: ``{module path: ExpertLoraLayer}`` holding the adapter.
        adapter_name: The adapter.
        prefix: PEFT's key prefix (``base_model.model.``).

    Returns:
        ``(settings, tensors)``: ``{parameter full name: (r, alpha, use_rslora)}`` and the
        tensors by PEFT key.
    """
    settings, tensors = {}, {}
    for path, layer in layers.items():
        for pname, where in peft_prefixes(path, layer, adapter_name).items():
            s = layer.settings[adapter_name][pname]
            settings[f"{path}.{pname}"] = (s["r"], float(s["alpha"]), bool(s["use_rslora"]))
            a, b = to_peft(layer.lora_A[adapter_name][pname].detach(),
                           layer.lora_B[adapter_name][pname].detach())
            tensors[f"{prefix}{where}.lora_A.weight"] = a.cpu().contiguous()
            tensors[f"{prefix}{where}.lora_B.weight"] = b.cpu().contiguous()
    return settings, tensors


def take_expert_tensors(tensors: dict[str, torch.Tensor], model: nn.Module, cfg: dict,
                        prefix: str) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """Take the expert pairs of a PEFT file with ``target_parameters`` out of its tensors.

    Args:
        tensors: The file's tensors by PEFT key (not changed).
        model: The base model (no adapter yet).
        cfg: The PEFT config (``target_parameters``, ``lora_alpha``, ``alpha_pattern``,
            ``use_rslora``).
        prefix: PEFT's key prefix.

    Returns:
        ``(structure, state, rest)``: ``{module path: {"parameters": {name: {"r", "alpha",
        "use_rslora"}}}}`` for :func:`rankwise.adapters.lora.apply_lora`, the pairs in
        rankwise's layout by adapter state key, and the other tensors.

    Raises:
        RankwiseError: If a targeted parameter has no pair in the file, or the model has no
            such 3-D parameter.
    """
    from rankwise.adapters.lora.apply import pattern_value
    names = cfg.get("target_parameters") or []
    targets = find_parameter_targets(model, names, what="PEFT target_parameters")
    rest = dict(tensors)
    structure: dict[str, dict] = {}
    state: dict[str, torch.Tensor] = {}
    rslora = bool(cfg.get("use_rslora", False))
    for path, pnames in targets.items():
        k = len(pnames)
        for i, pname in enumerate(pnames):  # registration order, as PEFT nests its wrappers
            where = f"{prefix}{path}" + ".base_layer" * (k - 1 - i)
            a, b = rest.pop(f"{where}.lora_A.weight", None), rest.pop(f"{where}.lora_B.weight", None)
            if a is None or b is None:
                raise RankwiseError(f"PEFT adapter targets {path}.{pname} but holds no pair at "
                                    f"{where}.lora_A/B.weight; re-save it with PEFT")
            experts = getattr(model.get_submodule(path), pname).shape[0]
            a, b = from_peft(a, b, experts)
            key = f"{path}.{pname}"
            alpha = pattern_value(key, cfg.get("alpha_pattern") or {}, cfg.get("lora_alpha", 8))
            structure.setdefault(path, {"parameters": {}})["parameters"][pname] = {
                "r": int(a.shape[1]), "alpha": float(alpha), "use_rslora": rslora}
            state[f"{path}.lora_A.{pname}"], state[f"{path}.lora_B.{pname}"] = a, b
    return structure, state, rest
