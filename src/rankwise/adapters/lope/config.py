"""LoPE configuration: the one place its defaults live."""
from __future__ import annotations

from dataclasses import dataclass

from rankwise.adapters.common.config import LoraPairConfig
from rankwise.configs import bounded


@dataclass
class LopeConfig(LoraPairConfig):
    """Asymmetric LoRA with a poisoning expert (LoPE, arXiv 2505.23868;
    docs/adapters-mixture-prompt.md).

    Per target layer: one shared ``A (r, in)``, ``num_experts`` normal ``B_i (out, r)``, one
    poisoning ``B_p (out, r)`` and a router over the ``num_experts + 1`` B experts. Trainable
    parameters per layer: ``r * in + (num_experts + 1) * (r * out + in)``.

    Training runs the paper's two stages (see :mod:`rankwise.adapters.lope.layer`): the first
    ``poison_steps`` training batches are generated noisy data (tokens and class labels
    replaced at ``noise_rate``) on which only the poisoning expert learns; afterwards the task
    data trains the normal experts with the poisoning expert frozen and present; inference
    masks it. The paper's stage lengths and noise recipe were not recoverable: the defaults
    are ours.

    A suitable AdamW learning rate is LoRA's range, 1e-3 to 5e-3 on the demo task.

    Attributes:
        name: Registry name (``lope``).
        r: Rank of the shared A.
        num_experts: Normal B experts (>= 1); the poisoning expert comes on top.
        alpha: Scale numerator (s = alpha / r, or alpha / sqrt(r) with ``use_rslora``).
        poison_steps: Training batches of stage 1 (generated noisy data, poisoning expert
            only); 0 skips stage 1 (every expert trains on the task data).
        noise_rate: Probability that stage 1 replaces a real token by a random token and a
            class label by a random class.
        renormalize: At inference, renormalise the normal experts' router weights over the
            normal experts (the masked expert's share is given back to them).
        noise_std: Optional Gaussian noise on the poisoning expert's input in training
            forwards, as a multiple of each token's RMS (our earlier stand-in; 0 = off).
        targets: ``"all-linear"``, a regex over module paths, or a list of name suffixes.
        exclude: Name suffixes never adapted.
        dropout: Dropout on the adapter input.
        use_rslora: s = alpha / sqrt(r).
        modules_to_save: Whole modules trained with the adapter (``None``: the task head).
    """

    name: str = "lope"
    num_experts: int = bounded(3, ge=1, hint="(normal experts; the poisoning expert is added on top)")
    poison_steps: int = bounded(20, ge=0)
    noise_rate: float = bounded(0.3, ge=0.0, le=1.0, what="a probability")
    renormalize: bool = True
    noise_std: float = bounded(0.0, ge=0)
