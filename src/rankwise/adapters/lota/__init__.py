"""LoTA-QAF (arXiv 2505.18724; docs/lota-qaf.md): a b-bit integer-grid base of our own, ternary
adapters merged by
integer arithmetic, and the registration of ``lota-qaf`` (its optimizer is ``t-signsgd``)."""
from __future__ import annotations

from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import adapt, rebuild_at_paths, target_paths
from rankwise.adapters.lota.config import SUPPORTED_BITS, LotaConfig
from rankwise.adapters.lota.layer import LotaLayer, ternarize, weight_bytes
from rankwise.adapters.lota.quant import QuantLinear, pack, quantize_linears, rtn_quantize, unpack
from rankwise.core import weights as layer_weights
from rankwise.core.inject import is_conv1d
from rankwise.errors import RankwiseError

__all__ = ["LotaConfig", "LotaLayer", "QuantLinear", "SUPPORTED_BITS", "apply_lota", "pack",
           "quantize_linears", "rtn_quantize", "ternarize", "unpack", "weight_bytes"]


def apply_lota(model: nn.Module, config: LotaConfig, adapter_name: str = "default",
               structure: dict[str, dict] | None = None) -> dict[str, LotaLayer]:
    """Quantize the target layers to the integer grid, add ternary adapter ``adapter_name`` and
    make only it (and the heads) trainable.

    Args:
        model: Any module with dense linear layers (changed in place: their weights are replaced
            by codes, scales and zero points).
        config: The method settings.
        adapter_name: Name of the adapter.
        structure: Optional per-path ``{"r", "threshold_ratio"}`` (loading).

    Returns:
        ``{path: LotaLayer}``.

    Raises:
        RankwiseError: On targets matching nothing, an already-quantized layer (by another
            library), a GPT-2 ``Conv1D`` layer (its quantized form would not keep the dense
            model's fingerprint, which records Conv1D weights as ``(in, out)``), or a group size that does not divide a layer's input size (all such layers
            are named in one message).
    """
    paths = target_paths(model, config)
    structure = structure or {}
    bad = []
    for path in paths:
        module = model.get_submodule(path)
        if isinstance(module, LotaLayer):
            continue
        if layer_weights.is_quantized(module):
            raise RankwiseError(f"{path} is already quantized ({type(layer_weights.base_layer(module)).__name__}); "
                                "lota-qaf quantizes a dense model itself: load it without model.quantize")
        if is_conv1d(layer_weights.base_layer(module)):
            raise RankwiseError(f"{path} is a GPT-2 Conv1D layer; lota-qaf quantizes nn.Linear layers "
                                "(Llama, Qwen, BERT-style models)")
        n_in = layer_weights.shape(module)[1]
        group = min(config.group_size, n_in)
        if n_in % group or n_in % (8 // config.bits):
            bad.append(f"{path} (in={n_in})")
    if bad:
        raise RankwiseError(f"method.group_size: {config.group_size} (capped at the input size) does "
                            f"not divide the input size of {', '.join(bad[:3])}"
                            f"{' ...' if len(bad) > 3 else ''}; choose a group_size that divides "
                            "every target layer's input size")

    def wrap(path: str, module: nn.Module) -> nn.Module:
        if not isinstance(module, LotaLayer):
            base = QuantLinear.from_linear(module, config.bits, min(config.group_size, layer_weights.shape(module)[1]))
            module = LotaLayer(base, config.fold_offsets)
        s = structure.get(path, {})
        module.add(adapter_name, int(s.get("r", config.r)), float(s.get("threshold_ratio", config.threshold_ratio)))
        return module

    return adapt(model, config, adapter_name, wrap, paths)


# rebuild: the quantization is deterministic, so the same dense base gives the same codes; the
# saved {path: {"r", "threshold_ratio"}} restores each adapter
registry.register("method", "lota-qaf", LotaConfig, apply_lota,
                  rebuild=rebuild_at_paths(apply_lota, structure=True),
                  summary="LoTA-QAF: ternary adapters on a b-bit integer grid, lossless merge")
