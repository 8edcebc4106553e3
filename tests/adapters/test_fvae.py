"""FVAE-LoRA: zero-initialised encoder heads (base output at init), B reads z1 only, the
posterior mean at evaluation, and the objective of notes §4.1 term by term."""
from __future__ import annotations

import math

import torch
from torch import nn

from rankwise.adapters.fvae import FvaeLoraConfig, FvaeLoraLayer, apply_fvae_lora
from rankwise.core.protocol import aux_losses
from rankwise.testing import tiny_batch, tiny_bert_cls

SETTINGS = {"enc_hidden": 8, "enc_layers": 1, "dec_hidden": 8, "dec_layers": 1, "enc_dropout": 0.0,
            "dec_dropout": 0.0, "latent_fusion": "concat", "z2_prior_mean": 1.5,
            "lambda_reconstruction": 0.5, "lambda_kl": 2.0, "lambda_z2": 3.0, "lambda_z1": 0.25}


def make_layer(aux_scale=0.1) -> FvaeLoraLayer:
    torch.manual_seed(0)
    layer = FvaeLoraLayer(nn.Linear(6, 5))
    vae = layer.add("default", r=3, alpha=6.0, settings=SETTINGS, aux_scale=aux_scale)
    with torch.no_grad():
        for head in (vae.enc_z1.mean, vae.enc_z1.logvar, vae.enc_z2.mean, vae.enc_z2.logvar):
            head.weight.normal_(std=0.5)
        vae.dec_scale.uniform_(0.5, 2.0)
    return layer


def test_zero_heads_give_the_base_output_in_eval():
    layer = FvaeLoraLayer(nn.Linear(6, 5))
    layer.add("default", r=3, alpha=6.0, settings=SETTINGS, aux_scale=1.0)
    layer.eval()
    x = torch.randn(4, 6)
    assert torch.equal(layer(x), layer.base_layer(x))


def test_eval_uses_the_posterior_mean_of_z1_only():
    layer = make_layer()
    vae = layer.vaes["default"]
    x = torch.randn(2, 4, 6)
    layer.eval()
    mu1, _ = vae.enc_z1(x.reshape(-1, 6))
    want = layer.base_layer(x) + (mu1 @ vae.lora_B.T * 2.0).reshape(2, 4, 5)
    torch.testing.assert_close(layer(x), want, atol=1e-6, rtol=0)
    with torch.no_grad():
        vae.enc_z2.mean.weight.add_(1.0)                        # z2 never reaches the output
    torch.testing.assert_close(layer(x), want, atol=1e-6, rtol=0)
    assert layer.aux_losses() == {}


def test_training_samples_z1_and_reports_the_weighted_objective():
    layer = make_layer(aux_scale=0.1)
    vae = layer.vaes["default"]
    x = torch.randn(5, 6)
    layer.train()
    torch.manual_seed(7)
    y = layer(x)
    aux = {k: float(v.detach()) for k, v in layer.aux_losses().items()}
    torch.manual_seed(7)                                         # the same eps, by hand
    mu1, lv1 = vae.enc_z1(x)
    mu2, lv2 = vae.enc_z2(x)
    z1 = mu1 + (0.5 * lv1).exp() * torch.randn_like(mu1)
    z2 = mu2 + (0.5 * lv2).exp() * torch.randn_like(mu2)
    torch.testing.assert_close(y, layer.base_layer(x) + z1 @ vae.lora_B.T * 2.0, atol=1e-6, rtol=0)
    recon = vae.dec_out(vae.dec_trunk(torch.cat([z1, z2], -1)))
    sigma = vae.dec_scale.abs() + 1e-5
    nll = torch.distributions.Normal(recon, sigma).log_prob(x).sum(-1).neg().mean()
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(mu1, (0.5 * lv1).exp()),
                                           torch.distributions.Normal(0.0, 1.0)).sum(-1).mean()
    want = {"fvae_reconstruction": 0.1 * 0.5 * nll, "fvae_kl_z1": 0.1 * 2.0 * kl,
            "fvae_z2_prior": 0.1 * 3.0 * ((z2 - 1.5) ** 2).mean(), "fvae_z1_repulsion": -0.1 * 0.25 * (z1 ** 2).mean()}
    for key, value in want.items():
        assert math.isclose(aux[key], float(value), rel_tol=1e-5, abs_tol=1e-6), key


def test_layers_mean_and_lambda_task():
    model = tiny_bert_cls()
    cfg = FvaeLoraConfig(r=2, enc_hidden=4, dec_hidden=4, lambda_task=100.0, targets=["query", "value"])
    layers = apply_fvae_lora(model, cfg)
    assert len(layers) == 4 and all(m.vaes["default"].aux_scale == 1 / 400 for m in layers.values())
    model.train()
    model(**tiny_batch("bert"))
    total = aux_losses(model)
    per_layer = [m.aux_losses() for m in layers.values()]
    for key, value in total.items():                             # the engine's sum = layer mean / lambda
        torch.testing.assert_close(value, sum(p[key] for p in per_layer))
