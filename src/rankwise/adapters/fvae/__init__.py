"""FVAE-LoRA (arXiv 2510.19640; docs/adapters-mixture-prompt.md): config, layer, and the
registration."""
from __future__ import annotations

from dataclasses import asdict

from torch import nn

from rankwise import registry
from rankwise.adapters.common.build import adapt, rebuild_at_paths, target_paths
from rankwise.adapters.fvae.config import FvaeLoraConfig
from rankwise.adapters.fvae.layer import AUX_NAMES, FactorizedVae, FvaeLoraLayer

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
    paths = target_paths(model, config)
    settings = {k: v for k, v in asdict(config).items() if k in _VAE_KEYS}
    aux_scale = 1.0 / (config.lambda_task * len(paths))

    def wrap(path: str, module: nn.Module) -> nn.Module:
        layer = module if isinstance(module, FvaeLoraLayer) else FvaeLoraLayer(module)
        layer.add(adapter_name, config.r, config.alpha, settings, aux_scale)
        return layer

    return adapt(model, config, adapter_name, wrap, paths)


registry.register("method", "fvae-lora", FvaeLoraConfig, apply_fvae_lora,
                  rebuild=rebuild_at_paths(apply_fvae_lora),
                  summary="FVAE-LoRA: two VAE latents replace A; B reads the task latent (A4)")
