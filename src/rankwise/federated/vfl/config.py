"""The ``vfl:`` run config (``rankwise vfl CONFIG``): the one place its defaults live."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, Union

from rankwise.configs import bounded

# Feature columns of each dataset (the docstrings case: token positions).
WIDTHS = {"breast_cancer": 30, "digits": 64, "wine": 13, "docstrings": 32}
CLASSES = {"breast_cancer": 2, "digits": 10, "wine": 3, "docstrings": 8}
PARTIES = ("passive", "active")


@dataclass
class VFLConfig:
    """How a two-party split-learning run is set up.

    Attributes:
        dataset: ``breast_cancer`` (30 columns), ``digits`` (64), ``wine`` (13), all shipped
            with scikit-learn, or ``docstrings`` (the demo docstrings as 32 token positions).
        passive_columns: Column indices the passive party holds (default: the first half).
        active_columns: Column indices the active party holds (default: the rest).
        labels: The parties that hold the labels; split learning needs exactly ``[active]``.
        mode: ``sync`` (each step waits for the other party) or ``pubsub`` (PubSub-VFL).
        engine: For ``sync``: ``flower`` (a ServerApp-style loop driving the two parties as
            Flower ClientApps with Flower Messages) or ``direct`` (the same steps as plain calls).
        workers_passive: PubSub-VFL worker threads sharing the passive party's parameter server.
        workers_active: The same for the active party.
        staleness: Bound tau: a gradient computed on parameters more than tau updates older
            than the parameter server's are dropped instead of applied.
        buffer: Capacity of the embedding channel (published, not yet consumed batches).
        auto: Choose batch size, workers and staleness from measured system profiles
            (PubSub-VFL's profile-based configuration; see ``pubsub.choose_config``).
        batch_sizes: The candidate batch sizes of ``auto``.
        max_workers: The most workers per party ``auto`` may choose.
        cores: The cores each party's profile reports ``[passive, active]`` (default: this
            machine's count for both).
        batch_size: Samples per step.
        epochs: Passes over the training rows.
        lr: SGD learning rate of both parties.
        momentum: SGD momentum of both parties.
        hidden: Width of the bottom models' hidden layer.
        embed: Width of each bottom model's output (the embedding that crosses).
        top_hidden: Width of the top model's hidden layer.
        vocab: Hashed vocabulary of the docstrings case.
        test_fraction: Rows held out for the test accuracy.
        target_accuracy: The accuracy whose first crossing is reported as time to target.
        slow_party: ``none``, ``passive`` or ``active``: that party's every compute is
            stretched by ``slow_factor`` (heterogeneous resources; the stretch is a sleep).
        slow_factor: How many times slower the slow party computes (>= 1).
        latency_ms: One-way latency added to every embedding and gradient crossing.
        seed: Seed of the split, the models and the batch order.
    """

    dataset: Literal["breast_cancer", "digits", "wine", "docstrings"] = "breast_cancer"
    passive_columns: Union[list[int], None] = None
    active_columns: Union[list[int], None] = None
    labels: list[str] = field(default_factory=lambda: ["active"])
    mode: Literal["sync", "pubsub"] = "sync"
    engine: Literal["flower", "direct"] = "flower"
    workers_passive: int = bounded(2, ge=1)
    workers_active: int = bounded(2, ge=1)
    staleness: int = bounded(4, ge=0)
    buffer: int = bounded(8, ge=1)
    auto: bool = False
    batch_sizes: list[int] = field(default_factory=lambda: [16, 32, 64])
    max_workers: int = bounded(3, ge=1)
    cores: Union[list[int], None] = None
    batch_size: int = bounded(32, ge=1)
    epochs: int = bounded(20, ge=1)
    lr: float = bounded(0.05, gt=0)
    momentum: float = 0.0
    hidden: int = bounded(64, ge=1)
    embed: int = bounded(16, ge=1)
    top_hidden: int = bounded(32, ge=1)
    vocab: int = 512
    test_fraction: float = bounded(0.2, gt=0.0, lt=1.0)
    target_accuracy: float = 0.95
    slow_party: Literal["none", "passive", "active"] = "none"
    slow_factor: float = bounded(1.0, ge=1.0)
    latency_ms: float = bounded(0.0, ge=0)
    seed: int = 0

    def columns(self) -> tuple[list[int], list[int]]:
        """``(passive, active)`` column indices, defaults filled in."""
        width = WIDTHS[self.dataset]
        passive = list(self.passive_columns) if self.passive_columns is not None else list(range(width // 2))
        active = list(self.active_columns) if self.active_columns is not None else [
            c for c in range(width) if c not in set(passive)]
        return passive, active

    def core_counts(self) -> tuple[int, int]:
        """``(passive, active)`` cores of the parties' profiles."""
        if self.cores is not None:
            return int(self.cores[0]), int(self.cores[1])
        n = os.cpu_count() or 1
        return n, n

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        out = []
        width = WIDTHS.get(self.dataset, 0)
        passive, active = self.columns()
        for name, cols in (("passive_columns", passive), ("active_columns", active)):
            bad = [c for c in cols if not 0 <= c < width]
            if bad:
                out.append(f"{name}: {bad} out of range; {self.dataset} has columns 0..{width - 1}")
            if len(set(cols)) != len(cols):
                out.append(f"{name}: a column is listed twice; list each once")
            if not cols:
                out.append(f"{name}: empty; each party needs at least one column")
        both = sorted(set(passive) & set(active))
        if both:
            out.append(f"passive_columns/active_columns: columns {both} belong to both parties; "
                       "give each column to one party")
        if sorted(self.labels) != ["active"]:
            who = "both parties" if set(self.labels) >= set(PARTIES) else repr(self.labels)
            out.append(f"labels: got {self.labels!r} (labels with {who}); in split learning only "
                       "the active party holds them: labels: [active]")
        if self.cores is not None and (len(self.cores) != 2 or min(self.cores) < 1):
            out.append(f"cores: got {self.cores!r}; expected [passive, active], each >= 1")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            out.append(f"batch_sizes: got {self.batch_sizes!r}; expected positive integers")
        return out
