"""The causal-LM loss in chunks of tokens: the full ``(tokens x vocab)`` logits never exist.

A causal LM's unchunked loss holds the logits of every position at once, and in fp32 several
times over (the logits, their log-softmax kept for the backward, the gradients of both): at a
128k-256k vocabulary that is the largest tensor of a fine-tuning step by far. Here the model runs
as usual up to its output head, whose input (the final hidden states) is captured instead of
projected; the loss is then the sum over chunks of ``chunk_tokens`` *target* positions of

    CE(head(h_chunk).float(), y_chunk, reduction="sum")

each chunk under ``torch.utils.checkpoint`` (non-reentrant), so its logits are freed after its
forward and recomputed in the backward: one chunk's logits are alive at a time. The sum is the
unchunked sum (``F.cross_entropy(..., ignore_index=-100, reduction="sum")``) up to the order of
float additions; positions labelled ``-100`` are dropped before chunking (they carry no loss).
The head is called as a module, so an adapter wrapping it (LoRA on ``lm_head``), autocast and
quantized heads work unchanged. The price is one more head forward per target token in the
backward (``2 H V`` flops a token; a few % of a step above 1B parameters).

A model that changes the logits after the head (Gemma-2's soft-capping, Cohere's logit scale) is
detected by its output not being the placeholder the captured head returned; its loss is then
computed unchunked (one warning per model).
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100

_UNCHUNKABLE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def vocab_size(model: nn.Module) -> int | None:
    """The vocabulary size in ``model``'s (text) config, or ``None``."""
    config = getattr(getattr(model, "module", model), "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    vocab = getattr(config, "vocab_size", None)
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def output_head(model: nn.Module) -> nn.Module | None:
    """The module that turns ``model``'s final hidden states into logits (``lm_head``, or the
    adapter layer wrapping it), or ``None`` when the model names none."""
    inner = getattr(model, "module", model)  # a DDP-style wrapper
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


class _Capture:
    """What the captured head saw: its input, and the placeholder it returned."""

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None
        self.placeholder: torch.Tensor | None = None
        self.calls = 0


@contextlib.contextmanager
def captured_head(head: nn.Module, vocab: int) -> Iterator[_Capture]:
    """Within the block, ``head(x)`` stores ``x`` and returns a zero tensor of the logits' shape
    that takes no memory (an expanded scalar); the head's own forward is back afterwards.

    Args:
        head: The output head module.
        vocab: The logits' last dimension (only the placeholder's shape).

    Yields:
        The :class:`_Capture`.
    """
    cap = _Capture()

    def stash(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        cap.calls += 1
        cap.hidden = x
        cap.placeholder = x.new_zeros(()).expand(*x.shape[:-1], vocab)  # (B, T, V), no storage
        return cap.placeholder

    head.forward = stash  # an instance attribute: the module's hooks still run around it
    try:
        yield cap
    finally:
        del head.forward


def chunked_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                          labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Summed next-token cross-entropy of ``head(hidden)`` against ``labels``, chunk by chunk.

    Args:
        head: Hidden states ``(N, H)`` -> logits ``(N, V)``.
        hidden: ``(B, T, H)`` final hidden states (position ``t`` predicts token ``t + 1``).
        labels: ``(B, T)`` token ids, ``-100`` where no loss is wanted.
        chunk_tokens: Target positions per chunk (>= 1).

    Returns:
        A float32 scalar: the sum over target positions (``0`` with a graph when there is none).
    """
    targets = labels[:, 1:]                              # (B, T-1)
    keep = targets != IGNORE
    h = hidden[:, :-1][keep]                             # (N, H): the target positions only
    y = targets[keep]                                    # (N,)
    total = hidden[:, :0].sum().float()                  # 0 with a graph: no target, no error
    grad = torch.is_grad_enabled()
    for h_c, y_c in zip(h.split(chunk_tokens), y.split(chunk_tokens)):
        if grad:  # recompute this chunk's logits in the backward instead of keeping them
            total = total + checkpoint(_chunk_sum, head, h_c, y_c, use_reentrant=False)
        else:
            total = total + _chunk_sum(head, h_c, y_c)
    return total


def _chunk_sum(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
               y: torch.Tensor) -> torch.Tensor:
    logits = head(h)                                     # (n, V) in the autocast dtype
    return F.cross_entropy(logits.float(), y, reduction="sum")


def chunked_forward(model: nn.Module, forward: Callable[[], tuple[Any, dict]],
                    chunk_tokens: int) -> tuple[torch.Tensor, Any, dict] | None:
    """Run ``forward`` with ``model``'s head captured and return ``(loss sum, output, batch)``;
    ``None`` when the model cannot take the chunked path (no output head, a head called other
    than once, logits changed after the head): the caller then computes the loss unchunked.

    Args:
        model: The causal LM (possibly adapted, possibly wrapped with ``.module``).
        forward: Runs the model on the batch; returns ``(output, batch as forwarded)``.
        chunk_tokens: Target positions per chunk.

    Returns:
        ``(summed loss, model output whose ``logits`` is a storage-free placeholder, batch)``
        or ``None``.
    """
    head = output_head(model)
    inner = getattr(model, "module", model)
    if head is None or inner in _UNCHUNKABLE:
        return None
    vocab = vocab_size(model) or 0
    with captured_head(head, vocab) as cap:
        out, batch = forward()
    if cap.calls != 1 or getattr(out, "logits", None) is not cap.placeholder:
        _UNCHUNKABLE.add(inner)
        warnings.warn(f"{type(inner).__name__} changes its logits after the output head; its "
                      "loss is computed unchunked (train.loss_chunk_tokens does not apply)",
                      stacklevel=3)
        return None
    loss = chunked_cross_entropy(head, cap.hidden, batch["labels"], chunk_tokens)
    return loss, out, batch


__all__ = ["chunked_cross_entropy", "chunked_forward", "captured_head", "output_head", "vocab_size"]
