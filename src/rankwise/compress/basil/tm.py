"""Transformer matching (TM): after a block's layers are compressed, train their sparse values
and low-rank factors so the compressed block reproduces the dense block's outputs."""
from __future__ import annotations

import math

import torch
from torch import nn

from rankwise.compress.base import BlockForward, Compressed
from rankwise.compress.formats import decode_sparse, sparse_keep
from rankwise.core.inject import replace_module


class SparseLowRankLinear(nn.Module):
    """``y = x (S ⊙ mask + L R)ᵀ + b``: the trainable form of a 3BASiL layer during TM.

    The mask multiplies ``S`` in the forward pass, so a pruned entry has zero gradient and
    zero effect whatever Adam does to it: the pattern survives training by construction.

    Args:
        s: ``(out, in)`` sparse values (zeros off the mask).
        keep: Boolean ``(out, in)`` mask.
        left: ``(out, r)``.
        right: ``(r, in)``.
        bias: The original layer's bias (kept fixed) or ``None``.
    """

    def __init__(self, s: torch.Tensor, keep: torch.Tensor, left: torch.Tensor,
                 right: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.s = nn.Parameter(s.clone())
        self.left, self.right = nn.Parameter(left.clone()), nn.Parameter(right.clone())
        self.register_buffer("keep", keep.to(s.dtype))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output."""
        weight = self.s * self.keep + self.left @ self.right                  # (out, in)
        return nn.functional.linear(x, weight.to(x.dtype), self.bias)


def _loss(forward: BlockForward, targets: list[torch.Tensor], index: list[int]) -> torch.Tensor:
    num = sum(((forward(i) - targets[i]) ** 2).sum() for i in index)
    den = sum(float((targets[i] ** 2).sum()) for i in index)
    return num / max(den, 1e-30)


def transformer_matching(compressor, block: nn.Module, layers: dict[str, Compressed],
                         forward: BlockForward, targets: list[torch.Tensor]) -> dict[str, Compressed]:
    """TM of 3BASiL-TM (released ``pipeline.py``): Adam on ``Σ ‖block_c(X) − block_dense(X)‖²``
    over the calibration batches, ``tm_epochs`` epochs of ``tm_batch`` batches per step,
    learning rate cosine-decayed from ``tm_lr`` to ``tm_lr / 5``.

    Only ``S``, ``L`` and ``R`` train (norms and biases stay as they are, so the compact file
    plus the untouched weights describe the model exactly); the loss is the squared error
    relative to the targets' energy. If the loss after TM is not lower than before, the layers
    are returned unchanged.

    Args:
        compressor: The :class:`~rankwise.compress.basil.admm.ThreeBasil` (config, encode).
        block: The block, target layers holding their decoded weights.
        layers: ``{path relative to block: Compressed}`` from the ADMM.
        forward: ``forward(i)``: the block's output on calibration batch ``i``.
        targets: The dense block's outputs.

    Returns:
        ``{path: Compressed}`` re-encoded from the trained factors, with ``tm_loss_before``
        and ``tm_loss_after`` in each layer's ``info``.
    """
    c = compressor.config
    frozen = {p: p.requires_grad for p in block.parameters()}
    for p in frozen:
        p.requires_grad_(False)
    originals, wrappers = {}, {}
    for path, comp in layers.items():
        module = block.get_submodule(path)
        shape = tuple(comp.weight.shape)
        keep = sparse_keep(comp.tensors, shape, c.nm)
        s = decode_sparse(comp.tensors, shape, c.nm)
        wrappers[path] = SparseLowRankLinear(s, keep, comp.tensors["L"].float(), comp.tensors["R"].float(),
                                             getattr(module, "bias", None))
        originals[path] = replace_module(block, path, wrappers[path])
    params = [p for w in wrappers.values() for p in (w.s, w.left, w.right)]
    opt = torch.optim.Adam(params, lr=c.tm_lr)
    chunks = [list(range(i, min(i + c.tm_batch, len(targets)))) for i in range(0, len(targets), c.tm_batch)]
    total = max(1, c.tm_epochs * len(chunks))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: 0.2 + 0.4 * (1 + math.cos(math.pi * min(k, total) / total)))
    everything = list(range(len(targets)))
    try:
        with torch.no_grad():
            before = float(_loss(forward, targets, everything))
        with torch.enable_grad():
            for _ in range(c.tm_epochs):
                for index in chunks:
                    opt.zero_grad(set_to_none=True)
                    _loss(forward, targets, index).backward()
                    opt.step()
                    sched.step()
        with torch.no_grad():
            after = float(_loss(forward, targets, everything))
    finally:
        for path, module in originals.items():
            replace_module(block, path, module)
        for p, flag in frozen.items():
            p.requires_grad_(flag)
    if not after < before:
        return {p: Compressed(comp.tensors, comp.weight, comp.params,
                              {**comp.info, "tm_loss_before": before, "tm_loss_after": before, "tm_kept": False})
                for p, comp in layers.items()}
    out = {}
    for path, w in wrappers.items():
        keep = w.keep.bool()
        s = w.s.detach() * keep
        info = {**layers[path].info, "tm_loss_before": before, "tm_loss_after": after, "tm_kept": True}
        out[path] = compressor.encode(s, keep, w.left.detach(), w.right.detach(), info)
    return out
