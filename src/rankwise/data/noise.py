"""Label noise for robustness experiments (``data.label_noise``): a deterministic fraction of the
*training* labels flipped to another class; evaluation labels stay clean.

``round(fraction * n)`` training examples, drawn without replacement by a NumPy generator seeded
with ``data.label_noise_seed``, each get a class drawn uniformly from the *other* classes, so
exactly that fraction of training labels is wrong (symmetric flip noise, as in LoPE's and most
noisy-label benchmarks). The same seed flips the same examples whatever ``train.seed`` is, so
seeds vary initialisation and data order over one fixed noisy set.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from rankwise.errors import RankwiseError


class NoisyLabels:
    """Training examples with some class labels replaced; everything else is the wrapped data's.

    Args:
        data: Examples with ``labels`` (class index per example) and ``label_names``.
        flipped: ``{example index: new class}``.
    """

    def __init__(self, data: Any, flipped: dict[int, int]) -> None:
        self.data, self.flipped = data, dict(flipped)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        item = self.data[i]
        return {**item, "label": self.flipped[int(i)]} if int(i) in self.flipped else item

    def rows(self, indices: list[int]) -> list[dict]:
        """Examples ``indices`` (read in one batch when the wrapped data can)."""
        items = self.data.rows(indices) if hasattr(self.data, "rows") else [self.data[i] for i in indices]
        return [{**it, "label": self.flipped[int(i)]} if int(i) in self.flipped else it
                for i, it in zip(indices, items)]

    @property
    def labels(self) -> list[int]:
        """Class index per example, flips applied."""
        return [self.flipped.get(i, y) for i, y in enumerate(self.data.labels)]

    def subset(self, index: list[int]) -> "NoisyLabels":
        """The examples ``index``, keeping their flipped labels."""
        pos = {int(i): k for k, i in enumerate(index)}
        return NoisyLabels(self.data.subset(index), {pos[i]: y for i, y in self.flipped.items() if i in pos})

    def __getattr__(self, name: str) -> Any:  # pad_id, label_names, lengths(), dropped, fmt ...
        if name == "data":
            raise AttributeError(name)
        return getattr(self.data, name)


def flip_labels(data: Any, fraction: float, seed: int) -> NoisyLabels:
    """Flip ``round(fraction * len(data))`` class labels of ``data`` to another class.

    Args:
        data: Training examples with class labels.
        fraction: Share of examples to flip, in [0, 1).
        seed: Seeds which examples flip and to what.

    Returns:
        The examples with the flips applied (``flipped`` maps example index -> new class).

    Raises:
        RankwiseError: If the data has no class labels or fewer than two classes.
    """
    labels = getattr(data, "labels", None)
    if labels is None or len(data.label_names) < 2:
        raise RankwiseError("data.label_noise flips class labels: it needs task.name: classification "
                            "and at least two labels; remove data.label_noise")
    n, classes = len(data), len(data.label_names)
    rng = np.random.default_rng(seed)
    chosen = rng.choice(n, size=int(round(fraction * n)), replace=False)
    shift = rng.integers(1, classes, size=len(chosen))                  # never the same class
    return NoisyLabels(data, {int(i): int((labels[i] + s) % classes) for i, s in zip(chosen, shift)})


__all__ = ["NoisyLabels", "flip_labels"]
