"""LoPE (arXiv 2505.23868; docs/adapters-mixture-prompt.md): config, layer, and the registration."""
from __future__ import annotations

import torch
from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import adapt, rebuild_at_paths
from rankwise.adapters.lope.config import LopeConfig
from rankwise.adapters.lope.layer import LopeLayer, NoiseInjection, PoisonedExperts, discrete_noise
from rankwise.core.ops import modules_to_save
from rankwise.core.token_mask import track_token_mask

__all__ = ["LopeConfig", "LopeLayer", "NoiseInjection", "PoisonedExperts", "apply_lope",
           "discrete_noise", "rebuild_lope"]
NOISE_CHILD = "lope_noise_injection"  # the model's child holding the two-stage schedule


def apply_lope(model: nn.Module, config: LopeConfig, adapter_name: str = "default"
               ) -> dict[str, LopeLayer]:
    """Inject LoPE adapter ``adapter_name`` into every target layer; only it (and the task
    head) trains.

    Args:
        model: Any module with linear layers.
        config: Rank, expert count, noise level.
        adapter_name: Name of the adapter.

    Returns:
        ``{path: LopeLayer}``.

    Raises:
        RankwiseError: If the targets match nothing or the rank does not fit a layer.
    """

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, LopeLayer) else LopeLayer(module)
        layer.add(adapter_name, config.r, config.num_experts, config.alpha, config.noise_std,
                  config.dropout, config.use_rslora, config.renormalize)
        return layer

    layers = adapt(model, config, adapter_name, wrap)
    track_token_mask(model)  # padding stays out of the router load
    if config.poison_steps > 0 and not hasattr(model, NOISE_CHILD):   # stage 1 on generated noise
        injection = NoiseInjection(config.poison_steps, config.noise_rate, torch.initial_seed() % 2**31)
        injection.hold_heads([model.get_submodule(p) for p in modules_to_save(model)])
        model.add_module(NOISE_CHILD, injection)
    return layers


def rebuild_lope(model: nn.Module, config: LopeConfig, adapter_name: str, layers: dict[str, dict]
                 ) -> dict[str, LopeLayer]:
    """Registry ``rebuild``: the saved layers, and the two-stage schedule where it stopped
    (``batches_seen`` of the saved structure), so a resumed run continues in the right stage.

    Args:
        model: The base model.
        config: The method config.
        adapter_name: Name of the adapter.
        layers: The saved structure ``{path: describe(name)}``.

    Returns:
        ``{path: LopeLayer}``.
    """
    out = rebuild_at_paths(apply_lope)(model, config, adapter_name, layers)
    seen = max((int(d.get("batches_seen", 0)) for d in (layers or {}).values()), default=0)
    injection = getattr(model, NOISE_CHILD, None)
    if injection is not None:
        injection.batches = seen
    for layer in out.values():
        layer.experts[adapter_name].batches_seen = seen
    return out


registry.register("method", "lope", LopeConfig, apply_lope, rebuild=rebuild_lope,
                  summary="LoPE: shared-A LoRA experts + a poisoning expert masked at inference (A6)")
