"""Input statistics of target layers over calibration batches (EVA's and CorDA's data).

The batches are the ones every data-driven init receives through the registry's
``needs_batches`` hook (``rankwise train`` draws ``train.calibration_batches`` of them from the
training data, as for GoRA). Each target's forward pre-hook adds its inputs ``x`` (the
positions the batch's ``attention_mask`` keeps - padding is left out, as PEFT's EVA does - or
every position, flattened to ``(n, in)``) into ``sum x x^T`` (``(in, in)``, float32), ``sum x``
and a count; the model runs in eval mode without gradients. Memory: one ``in x in`` float32
matrix per target.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from rankwise.errors import RankwiseError


@dataclass
class InputStats:
    """``sum x x^T`` (``gram``), ``sum x`` (``total``) and ``count`` of one layer's inputs."""

    gram: torch.Tensor
    total: torch.Tensor
    count: int = 0

    def covariance(self) -> torch.Tensor:
        """``X^T X / n`` (uncentred, CorDA's ``C``)."""
        return self.gram / max(self.count, 1)

    def mean(self) -> torch.Tensor:
        """The mean input vector."""
        return self.total / max(self.count, 1)


def input_statistics(model: nn.Module, paths: list[str], in_features: dict[str, int],
                     batches: Iterable[dict] | None, init: str) -> dict[str, InputStats]:
    """Run ``model`` on ``batches`` and collect each target's input statistics.

    Args:
        model: The model (targets not yet wrapped, or wrapped: the hook sees the same input).
        paths: Target module paths.
        in_features: ``{path: in_features}``.
        batches: Dicts for ``model(**batch)``.
        init: The init asking (for the error message).

    Returns:
        ``{path: InputStats}``.

    Raises:
        RankwiseError: If there are no batches.
    """
    if batches is None:
        raise RankwiseError(f"method.init: {init} needs calibration batches: set "
                            "train.calibration_batches >= 1 (rankwise train) or pass batches= "
                            "to rankwise.apply")
    stats: dict[str, InputStats] = {}
    current: dict[str, torch.Tensor | None] = {}  # the running batch's attention mask
    handles = []

    def hook_for(path: str):
        def hook(module, args):
            x = args[0].detach()
            mask = current.get("mask")
            if mask is not None and x.dim() == 3 and tuple(x.shape[:2]) == tuple(mask.shape):
                x = x[mask.bool()]                                   # (real tokens, in)
            x = x.reshape(-1, x.shape[-1]).float()                   # (n, in)
            s = stats.get(path)
            if s is None:
                d = in_features[path]
                s = stats[path] = InputStats(x.new_zeros(d, d), x.new_zeros(d))
            s.gram.addmm_(x.T, x)
            s.total.add_(x.sum(0))
            s.count += x.shape[0]
        return hook

    for path in paths:
        handles.append(model.get_submodule(path).register_forward_pre_hook(hook_for(path)))
    was_training = model.training
    model.eval()
    seen = 0
    try:
        with torch.no_grad():
            for batch in batches:
                current["mask"] = batch.get("attention_mask")
                model(**batch)
                seen += 1
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not seen or len(stats) < len(paths):
        raise RankwiseError(f"method.init: {init} got no calibration batch reaching every target; "
                            "set train.calibration_batches >= 1")
    return stats
