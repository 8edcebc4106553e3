"""Natural (label-owning organisations) and Dirichlet (flwr-datasets) partitions."""
from __future__ import annotations

import random

import pytest

from rankwise.errors import RankwiseError
from rankwise.federated.partition import dirichlet_partition, natural_partition


def labels(n=400, k=8, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(k) for _ in range(n)]


def test_natural_each_label_owned_by_one_client():
    y = labels()
    parts = natural_partition(y, 4, seed=0)
    assert sorted(i for p in parts for i in p) == list(range(len(y)))
    owned = [{y[i] for i in p} for p in parts]
    assert all(len(o) == 2 for o in owned)
    assert set().union(*owned) == set(range(8)) and sum(len(o) for o in owned) == 8


def test_natural_more_clients_than_labels_splits_labels():
    y = labels(k=2)
    parts = natural_partition(y, 4, seed=0)
    assert all(len({y[i] for i in p}) == 1 for p in parts)
    assert abs(len(parts[0]) - len(parts[2])) <= len(y) // 2


def test_natural_too_many_clients():
    with pytest.raises(RankwiseError, match="fewer federated.clients"):
        natural_partition([0, 1], 3)


def test_dirichlet_is_deterministic_and_complete():
    y = labels()
    a = dirichlet_partition(y, 4, alpha=0.3, seed=1)
    assert a == dirichlet_partition(y, 4, alpha=0.3, seed=1)
    assert sorted(i for p in a for i in p) == list(range(len(y)))
    assert min(map(len, a)) >= 2
    skew = max(max(sum(y[i] == c for i in p) for c in range(8)) / len(p) for p in a)
    assert skew > 0.3   # small alpha: some client is dominated by one label
