"""A next-token model without attention and variable-length examples, small enough to check
an engine step against a hand-written one."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.engine import Engine
from rankwise.tasks import CausalLMTask

VOCAB, HIDDEN, PAD = 11, 6, 0


class ToyLM(nn.Module):
    """``logits_t = head(tanh(proj(emb(x_t))))``: every position on its own, so padding never
    changes a real position's logits (micro-batches padded to other widths give the same
    per-token losses)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, attention_mask=None, **_):
        return SimpleNamespace(logits=self.head(torch.tanh(self.proj(self.emb(input_ids)))))  # (B, T, V)


class Examples(list):
    """Indexable examples with the ``pad_id`` the engine collates with."""

    pad_id = PAD


def examples(n: int = 12, seed: int = 1) -> Examples:
    """``n`` token sequences of lengths 2..9 (ids 1..VOCAB-1), fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out = Examples()
    for i in range(n):
        length = 2 + i % 8
        out.append({"input_ids": torch.randint(1, VOCAB, (length,), generator=g).tolist()})
    return out


def engine(model: nn.Module | None = None, data: Examples | None = None, lr: float = 0.5,
           **kwargs) -> Engine:
    """An :class:`Engine` stepping ``model`` with plain SGD (update = -lr * gradient)."""
    model = model or ToyLM()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    kwargs.setdefault("batch_size", 6)
    return Engine(model, CausalLMTask(), opt, data if data is not None else examples(), **kwargs)


def token_mean_loss(model: nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """Next-token cross-entropy summed over every predicted token of every sequence, divided
    by the number of predicted tokens (one sequence at a time, no padding)."""
    total = sum(F.cross_entropy(model(torch.tensor([s])).logits[0, :-1], torch.tensor(s[1:]),
                                reduction="sum") for s in seqs)
    return total / sum(len(s) - 1 for s in seqs)
