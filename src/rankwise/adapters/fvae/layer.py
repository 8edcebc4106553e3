"""FVAE-LoRA: a factorized VAE in place of LoRA's A (an ``AdapterModule``).

Kumar et al., "Factorized Variational Autoencoder LoRA" (FVAE-LoRA), NeurIPS 2025, arXiv
2510.19640; the layer follows the authors' ``FVAEPEFTLoraLayerWrapped`` / ``FVAE``.
For one adapted layer with input ``x (in)``::

    q(z1|x) = N(mu1(x), diag e^{lv1(x)}),  q(z2|x) = N(mu2(x), diag e^{lv2(x)})   # MLP encoders,
                                                                             # zero-initialised heads
    p(x|z1, z2) = N(dec([z1, z2]), diag sigma^2)                             # sigma learned, init 1
    training:  y = W x + s B z1,   z1 = mu1 + e^{lv1/2} eps                  # reparameterised sample
    eval:      y = W x + s B mu1(x)                                          # the posterior mean
    per-layer terms (reported by ``aux_losses``, each weighted and divided by
    lambda_task * number of FVAE layers, so the engine adds the paper's layer mean):
        NLL = -log p(x|z1, z2),  KL(q(z1|x) || N(0, I)),  mean((z2 - mu_z2)^2),  -mean(z1^2)

``B (out, r) ~ N(0, 0.02^2)``; with zero encoder heads ``mu1 = 0`` at initialisation, so in eval
mode the adapted model equals the base model. Choices where the code is loose: the decoder
scale enters as ``|sigma| + 1e-5`` (the code feeds it raw to ``scale_tril``, which breaks for a
negative value); the code's unused ``lora_E`` and KL(q(z2)) are left out. Not mergeable: the
encoder is non-linear in ``x``.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rankwise.adapters.common.factors import lora_scale
from rankwise.adapters.common.layers import UnmergeableLayer
from rankwise.errors import RankwiseError

AUX_NAMES = ("fvae_reconstruction", "fvae_kl_z1", "fvae_z2_prior", "fvae_z1_repulsion")


def _mlp(n_in: int, hidden: int, layers: int, dropout: float) -> tuple[nn.Sequential, int]:
    """``layers`` x (Linear, ReLU, Dropout); returns the trunk and its output width."""
    mods: list[nn.Module] = []
    width = n_in
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
        width = hidden
    return nn.Sequential(*mods), width


class GaussianEncoder(nn.Module):
    """``x -> (mu, logvar)`` of a diagonal Gaussian; both heads start at zero (q = N(0, I))."""

    def __init__(self, n_in: int, r: int, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.trunk, width = _mlp(n_in, hidden, layers, dropout)
        self.mean, self.logvar = nn.Linear(width, r), nn.Linear(width, r)
        for head in (self.mean, self.logvar):
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, logvar)`` of ``q(z|x)``, log-variance clamped to [-20, 20] as in the authors' code."""
        h = self.trunk(x)
        return self.mean(h), self.logvar(h).clamp(-20.0, 20.0)


class FactorizedVae(nn.Module):
    """One named FVAE-LoRA adapter of a layer (see the module docstring).

    Args:
        n_in: Input features (the decoder reconstructs them).
        n_out: Output features.
        r: Latent size.
        scaling: s = alpha / r.
        settings: The remaining :class:`~rankwise.adapters.fvae.config.FvaeLoraConfig` values
            (widths, dropouts, fusion, prior mean, lambdas).
        aux_scale: ``1 / (lambda_task * number of FVAE layers)``.
    """

    def __init__(self, n_in: int, n_out: int, r: int, scaling: float, settings: dict[str, Any],
                 aux_scale: float) -> None:
        super().__init__()
        s = settings
        self.enc_z1 = GaussianEncoder(n_in, r, s["enc_hidden"], s["enc_layers"], s["enc_dropout"])
        self.enc_z2 = GaussianEncoder(n_in, r, s["enc_hidden"], s["enc_layers"], s["enc_dropout"])
        self.concat = s["latent_fusion"] == "concat"
        self.dec_trunk, width = _mlp(2 * r if self.concat else r, s["dec_hidden"], s["dec_layers"],
                                     s["dec_dropout"])
        self.dec_out = nn.Linear(width, n_in)
        self.dec_scale = nn.Parameter(torch.ones(n_in))
        self.lora_B = nn.Parameter(torch.randn(n_out, r) * 0.02)
        self.scaling, self.aux_scale, self.settings = scaling, float(aux_scale), s
        self.last_aux: dict[str, torch.Tensor] = {}

    def terms(self, x: torch.Tensor, mu1, lv1, mu2, lv2, z1, z2) -> dict[str, torch.Tensor]:
        """The four weighted per-layer terms for tokens ``x (N, in)`` and their latents."""
        s, c = self.settings, self.aux_scale
        z = torch.cat([z1, z2], -1) if self.concat else (z1 + z2) / 2
        recon = self.dec_out(self.dec_trunk(z))                                # (N, in)
        sigma = self.dec_scale.abs() + 1e-5
        nll = (0.5 * ((x - recon) / sigma) ** 2 + sigma.log()).sum(-1) + 0.5 * x.shape[-1] * math.log(2 * math.pi)
        kl = 0.5 * (mu1 ** 2 + lv1.exp() - 1.0 - lv1).sum(-1)                  # KL(q(z1|x) || N(0, I))
        return {"fvae_reconstruction": c * s["lambda_reconstruction"] * nll.mean(),
                "fvae_kl_z1": c * s["lambda_kl"] * kl.mean(),
                "fvae_z2_prior": c * s["lambda_z2"] * ((z2 - s["z2_prior_mean"]) ** 2).mean(),
                "fvae_z1_repulsion": -c * s["lambda_z1"] * (z1 ** 2).mean()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``s B z1`` for float32 tokens ``x (N, in)`` (``z1`` sampled in training, ``mu1`` in eval)."""
        mu1, lv1 = self.enc_z1(x)
        if not self.training:
            self.last_aux = {}
            return (mu1 @ self.lora_B.T) * self.scaling
        mu2, lv2 = self.enc_z2(x)
        z1 = mu1 + (0.5 * lv1).exp() * torch.randn_like(mu1)
        z2 = mu2 + (0.5 * lv2).exp() * torch.randn_like(mu2)
        self.last_aux = self.terms(x, mu1, lv1, mu2, lv2, z1, z2)
        return (z1 @ self.lora_B.T) * self.scaling


class FvaeLoraLayer(UnmergeableLayer):
    """A linear-like layer with named FVAE-LoRA adapters (``AdapterModule``, not mergeable).

    Args:
        base_layer: ``nn.Linear``, ``Conv1D`` or a quantized linear; never modified.
    """

    adapters_attr = "vaes"
    adapter_kind = "FVAE-LoRA"
    unmergeable_reason = ("its latent z1 comes from a non-linear encoder of the input; keep it as "
                          "an adapter: export with --format rankwise")

    def add(self, name: str, r: int, alpha: float, settings: dict[str, Any], aux_scale: float) -> FactorizedVae:
        """Add adapter ``name`` (latent size ``r``) and make it active.

        Raises:
            RankwiseError: If ``r`` is outside [1, min(in, out)].
        """
        limit = min(self.in_features, self.out_features)
        if not 1 <= r <= limit:
            raise RankwiseError(f"latent size r={r} is invalid for a {self.in_features}->"
                                f"{self.out_features} layer; choose r in [1, {limit}]")
        device = next(self.base_layer.parameters()).device
        vae = FactorizedVae(self.in_features, self.out_features, r,
                            lora_scale(r, alpha, False), settings, aux_scale).to(device)
        return self.hold(name, vae, {"r": r, "alpha": alpha})

    # ----- AdapterModule protocol -----------------------------------------------------------
    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """Every parameter of VAE ``name`` by its path (``enc_z1.mean.weight``, ``lora_B``...)."""
        return dict(self.vaes[name].named_parameters())

    def describe(self, name: str) -> dict[str, Any]:
        """Protocol capability: ``{"r", "alpha"}`` of adapter ``name``."""
        return dict(self.settings[name])

    # ----- compute ------------------------------------------------------------------------
    # forward: UnmergeableLayer's, W x plus every active adapter's s B z1; its last_aux holds
    # the four weighted ELBO terms of a training forward

    def extra_repr(self) -> str:
        return ", ".join(f"{n}: r={s['r']}" for n, s in self.settings.items())
