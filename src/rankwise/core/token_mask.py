"""Which positions of the current forward are real tokens, for layers that count per token.

An adapter layer sees hidden states ``(B, T, in)`` only, not the batch, so a router inside it
cannot tell padding from tokens: its expert load and balance loss would count padded positions
(and their share grows with the padding of the batch). :func:`track_token_mask` registers one
forward pre-hook on the model that hands the ``attention_mask`` of every forward to each module
declaring a ``token_mask`` attribute; such a module reads the rows of its own input with
:func:`valid_tokens`. A forward without a 2-D ``attention_mask`` sets ``None`` (every position
counts), so a mask never outlives its batch.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

_FLAG = "_rankwise_tracks_token_mask"


def _record(model: nn.Module, args: tuple, kwargs: dict) -> None:
    mask = kwargs.get("attention_mask")
    mask = mask if torch.is_tensor(mask) and mask.dim() == 2 else None
    for module in model.modules():
        if module is not model and "token_mask" in module.__dict__:
            module.token_mask = mask


def track_token_mask(model: nn.Module) -> None:
    """Give every module of ``model`` with a ``token_mask`` attribute the attention mask of each
    forward of ``model`` (idempotent; the hook is a plain function, so copies of the model keep
    it and update their own modules).

    Args:
        model: The model whose ``forward`` receives ``attention_mask`` as a keyword.
    """
    if getattr(model, _FLAG, False):
        return
    model.register_forward_pre_hook(_record, with_kwargs=True)
    setattr(model, _FLAG, True)


def valid_tokens(mask: Any, lead: torch.Size | tuple[int, ...]) -> torch.Tensor | None:
    """Which rows of an input with leading shape ``lead`` are real tokens.

    Args:
        mask: The recorded attention mask ``(B, T)`` or ``None``.
        lead: The input's shape without its feature axis: ``(B, T')`` (``T' <= T``: the last
            ``T'`` positions, as in a KV-cached decoding step) or ``(B T,)`` (flattened tokens).

    Returns:
        A bool tensor of shape ``lead``, or ``None`` when every row counts (no mask, or a shape
        the mask does not describe).
    """
    if not torch.is_tensor(mask):
        return None
    lead = tuple(lead)
    if len(lead) == 2 and lead[0] == mask.shape[0] and 0 < lead[1] <= mask.shape[1]:
        return mask[:, mask.shape[1] - lead[1]:].bool()
    if len(lead) == 1 and lead[0] == mask.numel():
        return mask.reshape(-1).bool()
    return None
