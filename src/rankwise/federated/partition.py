"""Split a labelled training set across federated clients.

* ``natural``: each client is an organisation owning whole labels (for the demo: whole stdlib
  packages). Labels are dealt round-robin to clients after a seeded shuffle; when there are
  more clients than labels, a label's examples are split evenly among the clients sharing it.
* ``dirichlet``: ``flwr-datasets``' ``DirichletPartitioner`` (per label, client shares drawn
  from Dir(alpha), redrawn until every client has ``min_partition_size`` examples).
"""
from __future__ import annotations

import random

from rankwise.errors import RankwiseError


def natural_partition(labels: list[int], num_clients: int, seed: int = 0) -> list[list[int]]:
    """Partition example indices by label ownership.

    Args:
        labels: Label of every example.
        num_clients: Number of clients.
        seed: Shuffles which labels each client owns.

    Returns:
        ``num_clients`` lists of example indices (sorted).

    Raises:
        RankwiseError: If a client would receive no data (more clients than examples).
    """
    classes = sorted(set(labels))
    order = classes[:]
    random.Random(seed).shuffle(order)
    owners: dict[int, list[int]] = {c: [] for c in classes}
    if num_clients <= len(classes):
        for i, c in enumerate(order):
            owners[c].append(i % num_clients)
    else:
        for k in range(num_clients):
            owners[order[k % len(order)]].append(k)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    seen: dict[int, int] = {c: 0 for c in classes}
    for idx, lab in enumerate(labels):
        own = owners[lab]
        parts[own[seen[lab] % len(own)]].append(idx)
        seen[lab] += 1
    empty = [k for k, p in enumerate(parts) if not p]
    if empty:
        raise RankwiseError(f"natural partition left clients {empty} without data; "
                            f"use fewer federated.clients (got {num_clients})")
    return parts


def dirichlet_partition(labels: list[int], num_clients: int, alpha: float, seed: int = 0,
                        min_size: int = 2) -> list[list[int]]:
    """Partition example indices with ``flwr_datasets.partitioner.DirichletPartitioner``.

    Args:
        labels: Label of every example.
        num_clients: Number of clients.
        alpha: Dirichlet concentration.
        seed: Partitioner seed.
        min_size: Minimum examples per client (the partitioner redraws until met).

    Returns:
        ``num_clients`` lists of example indices (sorted).

    Raises:
        RankwiseError: If the partitioner cannot satisfy ``min_size``.
    """
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner
    ds = Dataset.from_dict({"label": list(labels), "index": list(range(len(labels)))})
    part = DirichletPartitioner(num_partitions=num_clients, partition_by="label", alpha=alpha,
                                min_partition_size=min_size, self_balancing=False, seed=seed)
    part.dataset = ds
    try:
        return [sorted(part.load_partition(k)["index"]) for k in range(num_clients)]
    except ValueError as err:
        raise RankwiseError(f"Dirichlet partition failed ({err}); raise federated.alpha or "
                            "lower federated.clients") from None


def partition(labels: list[int], num_clients: int, kind: str, alpha: float, seed: int) -> list[list[int]]:
    """Dispatch to :func:`natural_partition` or :func:`dirichlet_partition`.

    Raises:
        RankwiseError: On an unknown kind or an impossible split.
    """
    if kind == "natural":
        return natural_partition(labels, num_clients, seed)
    if kind == "dirichlet":
        return dirichlet_partition(labels, num_clients, alpha, seed)
    raise RankwiseError(f"federated.partition: got {kind!r}; expected 'natural' or 'dirichlet'")
