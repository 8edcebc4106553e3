"""FVAE-LoRA configuration: the one place its defaults live."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rankwise.adapters.common.config import TargetedConfig
from rankwise.configs import bounded


@dataclass
class FvaeLoraConfig(TargetedConfig):
    """Factorized-VAE LoRA (Kumar et al., NeurIPS 2025, arXiv 2510.19640;
    docs/adapters-mixture-prompt.md).

    Per target layer a VAE with two encoders ``q(z1|x)``, ``q(z2|x)`` and a decoder
    reconstructing the layer input replaces LoRA's A; ``B`` reads ``z1`` only. Trainable
    parameters per layer, ``h`` = hidden width, one hidden layer, ``k`` = 1 or 2 for
    ``latent_fusion`` average/concat: ``2 (in h + h + 2 (h r + r)) + (k r h + h + h in + in) +
    in + out r``; each further hidden layer adds ``h^2 + h`` per MLP.

    Why the MLPs are smaller than the authors': their code uses three hidden layers of width
    1024 in each encoder and the decoder, sized for ViT-B and billion-parameter models. On a
    384-wide layer with r = 16 that is 7.6M parameters per adapted layer, 617 times LoRA-r16's
    12,288; the VAE would be the model, and no comparison at LoRA's budget is possible. One
    32-wide layer costs 47,008 (3.8 x LoRA-r16), and the comparisons set the width so that the
    whole adapter matches LoRA's budget (width 3 at r = 4 on MiniLM). Scale ``enc_layers``,
    ``enc_hidden``, ``dec_layers`` and ``dec_hidden`` with the model when the budget allows.
    Dropout costs no parameters, so the decoder's is the authors' 0.5; the encoders keep 0.1
    (our choice).

    The objective is the authors' (from their released code) divided by ``lambda_task`` (the engine weighs the
    task loss by 1; AdamW is invariant to that common scale up to eps and clipping)::

        L = L_task + mean_layers[ l_rec NLL(x|dec(z1,z2)) + l_kl KL(q(z1|x)||N(0,I))
                                 + l_z2 mean((z2 - mu_z2)^2) - l_z1 mean(z1^2) ] / lambda_task

    A suitable AdamW learning rate is 1e-3 to 5e-3 on the demo task (as LoRA's).

    Attributes:
        name: Registry name (``fvae-lora``).
        r: Latent size of z1 and z2 (LoRA's rank).
        alpha: Scale numerator (s = alpha / r).
        enc_hidden: Width of the encoder MLPs.
        enc_layers: Hidden layers of each encoder (0 = heads on the input).
        dec_hidden: Width of the decoder MLP.
        dec_layers: Hidden layers of the decoder (0 = a linear decoder).
        enc_dropout: Dropout in the encoders.
        dec_dropout: Dropout in the decoder (the authors' 0.5).
        latent_fusion: ``concat`` (decoder reads [z1, z2]) or ``average`` ((z1 + z2) / 2).
        z2_prior_mean: Mean of z2's prior (1.5 in the authors' code).
        lambda_task: lambda_down of the paper (its README uses 1000).
        lambda_reconstruction: Weight of the reconstruction NLL.
        lambda_kl: Weight of KL(q(z1|x) || N(0, I)).
        lambda_z2: Weight of the pull of z2 towards its prior mean.
        lambda_z1: Weight of the repulsion of z1 from the origin.
        targets: ``"all-linear"``, a regex over module paths, or a list of name suffixes.
        exclude: Name suffixes never adapted.
        modules_to_save: Whole modules trained with the adapter (``None``: the task head).
    """

    name: str = "fvae-lora"
    r: int = bounded(16, ge=1)
    alpha: float = bounded(16.0, gt=0)
    enc_hidden: int = bounded(32, ge=1)
    enc_layers: int = bounded(1, ge=0)
    dec_hidden: int = bounded(32, ge=1)
    dec_layers: int = bounded(1, ge=0)
    enc_dropout: float = bounded(0.1, ge=0.0, lt=1.0)
    dec_dropout: float = bounded(0.5, ge=0.0, lt=1.0)
    latent_fusion: Literal["concat", "average"] = "concat"
    z2_prior_mean: float = 1.5
    lambda_task: float = bounded(1000.0, gt=0)
    lambda_reconstruction: float = bounded(1.0, ge=0)
    lambda_kl: float = bounded(1.0, ge=0)
    lambda_z2: float = bounded(1.0, ge=0)
    lambda_z1: float = bounded(1.0, ge=0)

