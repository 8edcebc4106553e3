"""LoRA+'s param groups: the B factor of every low-rank pair steps at ``ratio`` times A's rate.

Hayou, Ghosh & Yu 2024, "LoRA+: Efficient Low Rank Adaptation of Large Models", section 3.2:
with ``eta_B = lambda eta_A`` (``lambda >> 1``) feature learning stays efficient as the width
grows. The groups follow HF PEFT's ``create_loraplus_optimizer`` (and the paper's released
code), which users compare against:

* ``B`` of every trainable pair, and every trainable 1-D tensor (biases, norms, DoRA's
  magnitude): ``lr * ratio``;
* a pair whose layer wraps an ``nn.Embedding``: both factors at ``embedding_lr`` (PEFT's
  ``loraplus_lr_embedding``; rankwise's own LoRA wraps linear layers only, so only a method
  that adapts embeddings through the protocol reaches this group);
* everything else (``A``, trainable-token rows, whole modules' matrices): ``lr``.

Pairs come from the protocol's ``factors(name)`` (``core.protocol.factors``), never from
parameter names, so every method with LoRA-shaped layers qualifies (``lora`` with rsLoRA / DoRA /
any init, ``gora``). One difference from PEFT: every group decays with the optimizer's
``weight_decay``, where PEFT exempts norm and bias tensors of the ``B`` group (equal at the
default ``weight_decay: 0``).
"""
from __future__ import annotations

from torch import nn

from rankwise.core.protocol import adapter_modules, factors
from rankwise.core.weights import base_layer
from rankwise.errors import RankwiseError


def loraplus_param_groups(model: nn.Module, lr: float, ratio: float, embedding_lr: float) -> list[dict]:
    """LoRA+'s param groups over ``model``'s trainable parameters (each once, model order).

    Args:
        model: An adapted model whose layers expose ``factors(name)``.
        lr: ``A``'s learning rate (the optimizer's ``lr``).
        ratio: ``eta_B / eta_A``.
        embedding_lr: The rate of pairs on embedding layers.

    Returns:
        The non-empty groups among ``[A and the rest (lr), embedding pairs (embedding_lr),
        B and 1-D tensors (lr * ratio)]``, each with its ``lr`` (the first is the ``lr`` group,
        so the logged learning rate stays ``optim.lr``).

    Raises:
        RankwiseError: If no trainable ``B`` factor exists (a method without LoRA-shaped layers).
    """
    role: dict[int, str] = {}
    for _, mod in adapter_modules(model):
        on_embedding = isinstance(base_layer(mod), nn.Embedding)
        for name in mod.adapter_names():
            pair = factors(mod, name)
            if pair is None:
                continue
            a, b = pair
            role[id(a)] = "embedding" if on_embedding else "a"
            role[id(b)] = "embedding" if on_embedding else "b"
    groups: dict[str, list[nn.Parameter]] = {"a": [], "embedding": [], "b": []}
    for p in dict.fromkeys(model.parameters()):
        if p.requires_grad:
            groups[role.get(id(p), "b" if p.ndim == 1 else "a")].append(p)
    if not any(role.get(id(p)) == "b" for p in groups["b"]):
        raise RankwiseError("optim.loraplus_lr_ratio raises the rate of the B factor of low-rank "
                            "pairs, and this model trains none; use a method with LoRA-shaped "
                            "layers (lora, gora) or remove optim.loraplus_lr_ratio")
    rates = {"a": lr, "embedding": embedding_lr, "b": lr * ratio}
    return [{"params": ps, "lr": rates[k]} for k, ps in groups.items() if ps]


HINT = ("LoRA+ (per-group rates for the B factors) is an option of optim.name: adamw; set "
        "optim.name: adamw, or remove it (altlora-plus is AltLoRA's own second-moment variant)")

__all__ = ["loraplus_param_groups", "HINT"]
