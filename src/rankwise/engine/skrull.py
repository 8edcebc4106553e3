"""Skrull-style scheduling of a global step's sequences over processes and micro-batches.

Skrull (Xu et al., 2025, "Skrull: Towards Efficient Long Context Fine-tuning through Dynamic
Data Scheduling", NeurIPS 2025, arXiv 2505.19609) balances mixed long/short sequences online: a step's work is not
its token count, because attention grows with the square of a sequence's length. rankwise
implements the paper's *global data scheduling* with its cost model, under its memory cap
(``bucket``, the paper's BucketSize); the paper's other half, distributing one long sequence
over several devices (distribution-aware context parallelism, DACP), is **not implemented**:
every sequence stays whole on one process, so a sequence longer than the cap is refused.

Cost of a sequence of ``L`` tokens (per layer, multiply-adds up to a common factor)::

    c(L) = a * L + b * L**2,     a / b = ``linear`` (default 12 * hidden size)

(the projections and MLP cost about 24 d^2 per token and causal attention about 2 d L, so
a/b = 12 d). The schedule of one global step, given the lengths of its examples:

1. **ranks**: longest-processing-time-first (LPT, Graham 1969): examples in decreasing cost,
   each to the process with the least cost so far (ties: fewer examples, then lower rank),
   except that every process keeps at least ``grad_accum`` examples (so each runs the same
   number of forwards, which FSDP2's collectives need). Unconstrained LPT's heaviest process
   is at most ``(4/3 - 1/(3 m))`` times the optimal one, and at most ``mean + max c`` (list
   scheduling), ``m`` processes.
2. **micro-batches**: each process sorts its examples by length and cuts them into
   ``grad_accum`` contiguous groups minimising the largest *padded* cost
   ``n * c(L_max)`` of a group (an exact min-max linear partition, dynamic programming), so
   long sequences are not padded against short ones and the micro-steps carry similar work.

Memory cap (``bucket``, tokens): the paper schedules under BucketSize, the most tokens one
device holds (activation memory grows linearly with tokens). rankwise's micro-batches are padded,
so the cap bounds each micro-batch's *padded* tokens ``n * L_max <= bucket``. Reading (the
paper's heuristic is not reproduced): step 1 only offers an example to processes whose examples
still fit ``grad_accum`` capped micro-batches (:func:`capped_groups`, the fewest capped groups of
a sorted list, greedy from the longest), and step 2's cut only considers capped groups. A
sequence longer than the cap, or a step that no capped plan fits, raises :class:`CapError`.

The step's examples, the loss normalisation by the whole step's targets and the gradients are
those of the unscheduled step (only the grouping changes, so losses agree to rounding); with
dropout the draws follow the new order.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from rankwise.errors import RankwiseError


def cost(lengths: Sequence[int] | np.ndarray, linear: float) -> np.ndarray:
    """``c(L) = linear * L + L**2`` per length (``b = 1``), float64."""
    L = np.asarray(lengths, dtype=np.float64)
    return linear * L + L * L


def padded_cost(lengths: Sequence[int], linear: float) -> float:
    """Work of one padded micro-batch: ``n * c(max L)`` (0 when empty)."""
    return float(len(lengths) * cost([max(lengths)], linear)[0]) if len(lengths) else 0.0


class CapError(RankwiseError):
    """No schedule fits the memory cap (the message names the sequence or step and the fix)."""


def capped_groups(lengths: Sequence[int], bucket: float) -> int:
    """The fewest contiguous groups of the lengths sorted longest first with padded tokens
    ``n * L_first <= bucket`` each (greedy: each group takes all it can; optimal because a
    group's limit depends only on its first, longest, example). ``inf`` if one length exceeds
    the cap."""
    s = sorted(lengths, reverse=True)
    groups, i = 0, 0
    while i < len(s):
        take = int(bucket // s[i]) if s[i] > 0 else len(s)
        if take < 1:
            return float("inf")
        groups, i = groups + 1, i + take
    return groups


def assign_ranks(costs: Sequence[float], world: int, min_items: int = 1,
                 lengths: Sequence[int] | None = None, bucket: float | None = None,
                 parts: int = 1) -> list[list[int]]:
    """LPT: positions of ``costs`` per process, each process getting at least ``min_items``.

    Args:
        costs: Cost per example.
        world: Processes.
        min_items: Examples every process must receive (``len(costs) >= world * min_items``).
        lengths: Tokens per example (with ``bucket``).
        bucket: Memory cap: an example only goes to a process whose examples then still fit
            ``parts`` micro-batches of at most ``bucket`` padded tokens (``None``: no cap).
        parts: Micro-batches per process (with ``bucket``).

    Returns:
        ``world`` lists of positions (each in increasing order).

    Raises:
        CapError: When no process can take an example under the cap.
    """
    n = len(costs)
    assert n >= world * min_items, "Distributed.problem refuses batches this small"
    order = sorted(range(n), key=lambda i: (-costs[i], i))
    loads = [(0.0, 0, r) for r in range(world)]            # (load, items, rank)
    out: list[list[int]] = [[] for _ in range(world)]
    deficit = world * min_items                            # items still owed to short processes

    def fits(r: int, i: int) -> bool:
        return bucket is None or capped_groups([lengths[j] for j in out[r]] + [lengths[i]], bucket) <= parts
    for k, i in enumerate(order):
        left = n - k
        pool = [e for e in loads if e[1] < min_items] if left <= deficit else loads
        ok = sorted(e for e in pool if fits(e[2], i))     # least loaded first
        if not ok:
            raise CapError(f"no process can take a {lengths[i]}-token example under the memory cap of "
                           f"{bucket:g} padded tokens per micro-batch with {parts} micro-batches each")
        load, items, r = ok[0]
        loads.remove((load, items, r))
        if items < min_items:
            deficit -= 1
        out[r].append(i)
        loads.append((load + float(costs[i]), items + 1, r))
    return [sorted(x) for x in out]


def split_micro(lengths: Sequence[int], parts: int, linear: float,
                bucket: float | None = None) -> list[list[int]]:
    """Cut examples into ``parts`` groups of consecutive lengths (longest first) minimising the
    largest padded cost of a group, each group within the memory cap.

    Args:
        lengths: Tokens per example.
        parts: Micro-batches (fewer when there are fewer examples).
        linear: ``a / b`` of the cost model.
        bucket: Most padded tokens ``n * L_max`` of a group (``None``: no cap).

    Returns:
        Positions into ``lengths`` per micro-batch (non-empty groups).

    Raises:
        CapError: When no cut into ``parts`` groups fits the cap.
    """
    n = len(lengths)
    parts = max(1, min(parts, n))
    order = sorted(range(n), key=lambda i: (-lengths[i], i))   # group j starts at its longest
    head = cost([lengths[i] for i in order], linear)           # c of the group's first example
    inf = float("inf")
    # best[p][i]: min over cuts of order[i:] into p groups of the largest n_g * c(first)
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[n] * (n + 1) for _ in range(parts + 1)]
    best[0][n] = 0.0
    for p in range(1, parts + 1):
        for i in range(n - p, -1, -1):
            for j in range(i + 1, n - p + 2):                  # first group order[i:j]
                if bucket is not None and (j - i) * lengths[order[i]] > bucket:
                    break                                      # longer groups only grow
                v = max((j - i) * head[i], best[p - 1][j])
                if v < best[p][i]:
                    best[p][i], cut[p][i] = v, j
    if best[parts][0] == inf:
        raise CapError(f"{n} examples (longest {max(lengths)} tokens) do not fit {parts} micro-batches "
                       f"of at most {bucket:g} padded tokens")
    groups, i = [], 0
    for p in range(parts, 0, -1):
        j = cut[p][i]
        groups.append(sorted(order[i:j]))
        i = j
    return groups


class Skrull:
    """The schedule of every global step of a run (see the module docstring).

    Args:
        world: Processes.
        rank: This process.
        grad_accum: Micro-batches per process and step.
        linear: ``a / b`` of the cost model (tokens).
        bucket: Memory cap, the most padded tokens of one micro-batch (``None``: no cap).
    """

    def __init__(self, world: int, rank: int, grad_accum: int, linear: float,
                 bucket: float | None = None) -> None:
        self.world, self.rank, self.grad_accum, self.linear = world, rank, grad_accum, float(linear)
        self.bucket = None if bucket is None else float(bucket)
        self._lengths: tuple[int, np.ndarray] | None = None

    @classmethod
    def for_model(cls, model: Any, world: int = 1, rank: int = 0, grad_accum: int = 1,
                  linear: float | None = None, bucket: float | None = None) -> "Skrull":
        """A schedule whose ``linear`` defaults to ``12 * model.config.hidden_size`` (768 when
        the model states none)."""
        hidden = getattr(getattr(model, "config", None), "hidden_size", None) or 64
        return cls(world, rank, grad_accum, linear if linear else 12.0 * hidden, bucket)

    def plan(self, lengths: Sequence[int]) -> list[list[list[int]]]:
        """Positions into ``lengths`` per process, then per micro-batch.

        Raises:
            CapError: A sequence longer than ``bucket`` (no context parallelism to split it), or
                a step that no capped plan fits.
        """
        if self.bucket is not None and lengths and max(lengths) > self.bucket:
            raise CapError(f"a {max(lengths)}-token sequence exceeds data.schedule.bucket "
                           f"({self.bucket:g}); rankwise has no context parallelism to split it: raise "
                           "data.schedule.bucket or lower data.max_length")
        ranks = assign_ranks(cost(lengths, self.linear).tolist(), self.world, self.grad_accum,
                             lengths, self.bucket, self.grad_accum)
        return [[[pos[j] for j in group]
                 for group in split_micro([lengths[i] for i in pos], self.grad_accum, self.linear, self.bucket)]
                for pos in ranks]

    def lengths(self, dataset: Any, indices: list[int]) -> list[int]:
        """Tokens of ``dataset[i]`` for ``indices`` (its ``lengths()`` read once, when it has one)."""
        if hasattr(dataset, "lengths"):
            if self._lengths is None or self._lengths[0] != id(dataset):
                self._lengths = (id(dataset), np.asarray(dataset.lengths()))
            return self._lengths[1][indices].astype(int).tolist()
        return [len(dataset[i]["input_ids"]) for i in indices]

    def micro_batches(self, dataset: Any, indices: list[int]) -> list[list[int]]:
        """This process's micro-batches of the global step ``indices`` (dataset indices)."""
        plan = self.plan(self.lengths(dataset, indices))
        return [[indices[j] for j in group] for group in plan[self.rank]]


__all__ = ["CapError", "Skrull", "assign_ranks", "capped_groups", "cost", "padded_cost", "split_micro"]
