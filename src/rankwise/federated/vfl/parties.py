"""The two parties of split learning, their data and models, and the traffic between them.

The passive party holds some feature columns and a bottom model ``f_p``; the active party holds
the other columns, its bottom model ``f_a``, the labels and the top model ``g``. One step on
rows ``B`` (split learning, Vepakomma et al. 2018; the two-party form of PubSub-VFL §3):

    z_p = f_p(x_p[B])                       passive -> active: the embedding z_p  (|B| x e floats)
    L = CE(g([z_p, f_a(x_a[B])]), y[B])     active: loss, gradients of f_a and g, and dL/dz_p
    f_p.backward(dL/dz_p)                   active -> passive: the gradient dL/dz_p (|B| x e floats)

so the bytes that cross per step are ``2 * |B| * e * 4`` (float32) plus the row ids; nothing
else of either party leaves it. Composed, the two parties compute exactly the centralised
model ``g([f_p(x_p), f_a(x_a)])`` (tested to 1e-6).
"""
from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rankwise.federated.vfl.config import CLASSES, VFLConfig


@dataclass
class VFLData:
    """Each party's view of the aligned rows (the same row index is the same sample id)."""

    x_passive: torch.Tensor       # (N, d_p) float32, or (N, T_p) int64 token ids
    x_active: torch.Tensor        # (N, d_a)
    y: torch.Tensor               # (N,) int64, the active party's labels
    x_passive_test: torch.Tensor
    x_active_test: torch.Tensor
    y_test: torch.Tensor
    classes: int
    tokens: bool                  # the docstrings case: columns are token positions


FILES = {"breast_cancer": ("breast_cancer.csv", 1), "digits": ("digits.csv.gz", 0), "wine": ("wine_data.csv", 1)}


def _tabular(name: str):
    """A table shipped with scikit-learn, read from its CSV in ``sklearn/datasets/data`` (the
    file ``sklearn.datasets.load_*`` reads; importing sklearn would cost seconds of scipy)."""
    import gzip
    import importlib.util

    import numpy as np
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        from rankwise.errors import RankwiseError
        raise RankwiseError(f"vfl.dataset {name} ships with scikit-learn, which is not installed: "
                            "pip install scikit-learn")
    file, header = FILES[name]
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / file
    with (gzip.open(path, "rt") if file.endswith(".gz") else open(path)) as f:
        table = np.loadtxt(f, delimiter=",", skiprows=header)
    return torch.tensor(table[:, :-1], dtype=torch.float32), torch.tensor(table[:, -1], dtype=torch.int64)


def _docstrings(width: int, vocab: int):
    """The demo docstrings as ``width`` hashed word ids each (0 = padding), label = package."""
    from rankwise.data.demo import load_demo_records
    records, _ = load_demo_records()
    rows = []
    for r in records:
        ids = [1 + zlib.crc32(w.lower().encode()) % (vocab - 1) for w in r["text"].split()[:width]]
        rows.append(ids + [0] * (width - len(ids)))
    return torch.tensor(rows, dtype=torch.int64), torch.tensor([r["label"] for r in records])


def load_data(cfg: VFLConfig) -> VFLData:
    """Load the dataset, split rows (seeded) into train/test and columns between the parties.

    Tabular columns are standardised with training-row statistics, each party its own columns
    (a local operation: no statistic crosses).
    """
    x, y = _docstrings(32, cfg.vocab) if cfg.dataset == "docstrings" else _tabular(cfg.dataset)
    g = torch.Generator().manual_seed(cfg.seed)
    perm = torch.randperm(len(y), generator=g)
    n_test = max(1, int(round(cfg.test_fraction * len(y))))
    test, train = perm[:n_test], perm[n_test:]
    tokens = cfg.dataset == "docstrings"
    if not tokens:
        mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-6)
        x = (x - mean) / std
    passive, active = cfg.columns()
    return VFLData(x[train][:, passive].contiguous(), x[train][:, active].contiguous(), y[train],
                   x[test][:, passive].contiguous(), x[test][:, active].contiguous(), y[test],
                   CLASSES[cfg.dataset], tokens)


class BottomMLP(nn.Module):
    """A party's bottom model on its feature columns: ``(B, d) -> (B, e)``."""

    def __init__(self, d_in: int, hidden: int, embed: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, embed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BottomTokens(nn.Module):
    """A party's bottom model on its token positions: mean of word vectors, then an MLP."""

    def __init__(self, vocab: int, hidden: int, embed: int) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, hidden, mode="mean", padding_idx=0)
        self.out = nn.Sequential(nn.ReLU(), nn.Linear(hidden, embed))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.bag(ids))  # (B, T) -> (B, hidden) -> (B, e)


class TopModel(nn.Module):
    """The active party's top model on ``[z_p, z_a]``: ``(B, 2e) -> (B, classes)``."""

    def __init__(self, embed: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2 * embed, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, z_passive: torch.Tensor, z_active: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([z_passive, z_active], dim=1))


class ActiveModel(nn.Module):
    """The active party's bottom and top model, as one module (one parameter server)."""

    def __init__(self, bottom: nn.Module, top: TopModel) -> None:
        super().__init__()
        self.bottom, self.top = bottom, top

    def forward(self, z_passive: torch.Tensor, x_active: torch.Tensor) -> torch.Tensor:
        return self.top(z_passive, self.bottom(x_active))


def build_models(cfg: VFLConfig, data: VFLData) -> tuple[nn.Module, ActiveModel]:
    """``(passive bottom model, active bottom + top model)``, seeded by ``cfg.seed``."""
    torch.manual_seed(cfg.seed)

    def bottom(x):
        return BottomTokens(cfg.vocab, cfg.hidden, cfg.embed) if data.tokens else BottomMLP(
            x.shape[1], cfg.hidden, cfg.embed)
    passive = bottom(data.x_passive)
    return passive, ActiveModel(bottom(data.x_active), TopModel(cfg.embed, cfg.top_hidden, data.classes))


def batch_order(n: int, batch_size: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """The row ids of every step: a seeded permutation per epoch cut into batches (the last
    batch of an epoch may be smaller). Both parties derive the same order (aligned ids)."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        out.extend(perm[i:i + batch_size] for i in range(0, n, batch_size))
    return out


class Traffic:
    """Thread-safe byte counter of what crosses between the parties, by kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes: dict[str, int] = {}
        self.messages: dict[str, int] = {}

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s payload (``numel * element size``) under ``kind``."""
        with self._lock:
            self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()
            self.messages[kind] = self.messages.get(kind, 0) + 1


def train_bytes_formula(batch_sizes: list[int], embed: int, dtype_bytes: int = 4) -> int:
    """Embedding + gradient bytes of steps with these batch sizes: ``sum_s 2 * |B_s| * e * 4``."""
    return sum(2 * b * embed * dtype_bytes for b in batch_sizes)


class Stretch:
    """Makes one party ``factor`` times slower: after each compute block it sleeps
    ``(factor - 1)`` times the block's own duration (a slower machine, modelled; the sleep
    uses no CPU, so a slowed party's extra workers overlap their sleeps as extra cores would)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.factor > 1.0:
            time.sleep((self.factor - 1.0) * (time.perf_counter() - self.t0))


def stretch_of(cfg: VFLConfig, party: str) -> float:
    """The slowdown factor of ``party`` under ``cfg``."""
    return cfg.slow_factor if cfg.slow_party == party else 1.0


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of rows whose arg-max class is the label."""
    return float((logits.argmax(1) == y).float().mean())
