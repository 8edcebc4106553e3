"""FVAE-LoRA (ROADMAP A4): config, layer, and the registration."""
from __future__ import annotations

from dataclasses import asdict

from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import rebuild_at_paths
from rankwise.adapters.fvae.config import FvaeLoraConfig
from rankwise.adapters.fvae.layer import AUX_NAMES, FactorizedVae, FvaeLoraLayer
from rankwise.core.inject import default_heads, find_targets, inject
from rankwise.core.ops import mark_trainable, set_modules_to_save
from rankwise.core.quant import keep_training_layout

__all__ = ["FvaeLoraConfig", "FvaeLoraLayer", "FactorizedVae", "AUX_NAMES", "apply_fvae_lora"]

_VAE_KEYS = ("enc_hidden", "enc_layers", "dec_hidden", "dec_layers", "enc_dropout", "dec_dropout",
             "latent_fusion", "z2_prior_mean", "lambda_reconstruction", "lambda_kl", "lambda_z2",
             "lambda_z1")


def apply_fvae_lora(model: nn.Module, config: FvaeLoraConfig, adapter_name: str = "default"
                    ) -> dict[str, FvaeLoraLayer]:
    """Inject FVAE-LoRA adapter ``adapter_name`` into every target layer; only it (and the task
    head) trains. Each layer's ELBO terms are divided by ``lambda_task`` times the number of
    adapted layers, so the engine's sum is the paper's mean over layers.

    Args:
        model: Any module with linear layers.
        config: Latent size, encoder/decoder widths, objective weights.
        adapter_name: Name of the adapter.

    Returns:
        ``{path: FvaeLoraLayer}``.

    Raises:
        RankwiseError: If the targets match nothing or ``r`` does not fit a layer.
    """
    paths = find_targets(model, config.targets, config.exclude, "method.targets")
    keep_training_layout(model)  # 4-bit bases: no CPU inference repacking while adapted
    settings = {k: v for k, v in asdict(config).items() if k in _VAE_KEYS}
    aux_scale = 1.0 / (config.lambda_task * len(paths))

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, FvaeLoraLayer) else FvaeLoraLayer(module)
        layer.add(adapter_name, config.r, config.alpha, settings, aux_scale)
        return layer

    layers = inject(model, paths, wrap)
    set_modules_to_save(model, default_heads(model) if config.modules_to_save is None
                        else config.modules_to_save)
    mark_trainable(model, adapter_name)
    return layers


registry.register("method", "fvae-lora", FvaeLoraConfig, apply_fvae_lora,
                  rebuild=rebuild_at_paths(apply_fvae_lora),
                  summary="FVAE-LoRA: two VAE latents replace A; B reads the task latent (A4)")
