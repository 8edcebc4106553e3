"""The LoRA pair's scale and initialisations, shared by every LoRA-shaped method.

LoRA, the LoRA mixtures (``moe-lora``, FedLEASE), LoPE and FVAE-LoRA all scale their pair by
``s = alpha / r`` (Hu et al. 2021, eq. 3) or rsLoRA's ``alpha / sqrt(r)`` (Kalajdzievski 2023),
and LoRA and the mixtures initialise it from one table and check its rank the same way, so these
live outside any one family.
"""
from __future__ import annotations

import math
from typing import Callable

from torch import nn

from rankwise.errors import RankwiseError


def _init_kaiming(a: nn.Linear, b: nn.Linear) -> None:
    nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
    nn.init.zeros_(b.weight)


def _init_gaussian(a: nn.Linear, b: nn.Linear) -> None:
    nn.init.normal_(a.weight, std=1.0 / a.out_features)
    nn.init.zeros_(b.weight)


# name -> fn(A, B) initialising the two factors in place; methods may register more.
LORA_INITS: dict[str, Callable[[nn.Linear, nn.Linear], None]] = {
    "kaiming": _init_kaiming,
    "gaussian": _init_gaussian,
}


def lora_scale(r: int, alpha: float, use_rslora: bool) -> float:
    """Return s = alpha / r, or alpha / sqrt(r) for rsLoRA (Kalajdzievski 2023)."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def check_rank(r: int, in_features: int, out_features: int) -> None:
    """Refuse a pair's rank outside ``[1, min(in, out)]`` of its layer.

    Raises:
        RankwiseError: Naming the layer's shape and the ranks it allows.
    """
    limit = min(in_features, out_features)
    if not 1 <= r <= limit:
        raise RankwiseError(f"rank {r} is invalid for a {in_features}->{out_features} "
                            f"layer; choose r in [1, {limit}], or leave the layer out (method.exclude)")
