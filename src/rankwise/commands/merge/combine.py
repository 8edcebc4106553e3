"""Combining several LoRA adapters of one base into one: the tensor maths of ``rankwise merge``.

Every function here works on one layer at a time and knows no method, file or model: a layer's
adapters come in as :class:`Pair` s, ``delta_i = scale_i * B_i @ A_i`` with ``A_i`` (r_i, in) and
``B_i`` (out, r_i), and one new pair ``(A, B)`` with scale 1 comes out. The semantics are those
of HF PEFT's ``LoraModel.add_weighted_adapter`` (peft 0.21), so that a user who merged with PEFT
gets the same adapter here; the papers behind the methods:

* ``linear``: weighted sums of the factors, ``A = sum_i sgn(c_i) sqrt|c_i| A_i`` and
  ``B = sum_i sqrt|c_i| B_i`` with ``c_i = w_i * scale_i`` (the sign on ``A`` only, so a negative
  weight subtracts). ``B A`` is NOT ``sum_i c_i B_i A_i``: the cross terms ``B_i A_j`` remain,
  which is why PEFT calls it a rough approximation. All ranks must be equal.
* ``cat``: ``A = [c_1 A_1; c_2 A_2; ...]``, ``B = [B_1, B_2, ...]``, so ``B A = sum_i c_i B_i A_i``
  exactly, at rank ``sum_i r_i``.
* ``svd``: ``D = sum_i c_i B_i A_i`` (task arithmetic, Ilharco et al. 2023, eq. 1), truncated to
  rank k by its SVD ``D ~ U_k S_k V_k^T``: ``B = U_k S_k``, ``A = V_k^T`` (Eckart-Young, the best
  rank-k approximation in Frobenius norm).
* ``ties`` (TIES-Merging, Yadav et al. 2023, Algorithm 1): per factor list (the ``A`` s, then the
  ``B`` s, with the ``linear`` coefficients) keep each tensor's top ``density`` fraction by
  magnitude ("trim"), elect the sign of each entry as the sign of the sum of the trimmed tensors
  ("elect"; ``frequency``: the sign of the count of signs), and average the weighted entries that
  agree with it ("disjoint merge": divide by how many agree, at least 1).
* ``dare_linear`` / ``dare_ties`` (DARE, Yu et al. 2024, eq. 2): drop each entry with
  probability ``1 - density`` and rescale the survivors by ``1 / density``, then sum as
  ``linear`` or elect and merge as ``ties``. The masks come from a seeded generator, drawn layer
  by layer in the caller's order and within a layer for every ``A_i`` then every ``B_i`` (PEFT's
  order, so seeding PEFT's global generator the same way right before its merge loop draws
  the same masks).

A ``density`` of 1 prunes nothing (and draws no random numbers), as in PEFT.

Each rule is a :class:`MergeRule` subclass, the builder of its entry of registry kind
``merge-rule`` (``rules.py`` registers them with their configs): it is made from its config and
says its rank (:meth:`MergeRule.rank`), whether it needs one common rank (``factorwise``) and
how it combines a layer (:meth:`MergeRule.combine`), so nothing branches on a rule's name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SIGN_METHODS = ("total", "frequency")


@dataclass
class Pair:
    """One adapter's LoRA pair in one layer: ``delta = scale * b @ a``.

    Args:
        a: ``A``, shape (r, in).
        b: ``B``, shape (out, r).
        scale: The adapter's scale in this layer (``alpha / r``, or ``alpha / sqrt(r)``).
    """
    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        """The pair's rank r."""
        return int(self.a.shape[0])


def trim(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """TIES' trim: keep the ``int(density * numel)`` entries of largest magnitude, zero the rest."""
    if density >= 1:
        return tensor
    keep = torch.zeros(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    keep[torch.topk(tensor.abs().flatten(), k=int(density * tensor.numel())).indices] = 1
    return tensor * keep.view_as(tensor)


def drop_and_rescale(tensor: torch.Tensor, density: float, generator: torch.Generator | None) -> torch.Tensor:
    """DARE (eq. 2): keep each entry with probability ``density`` (a Bernoulli mask drawn from
    ``generator``) and divide the survivors by ``density``."""
    if density >= 1:
        return tensor
    mask = torch.bernoulli(torch.full_like(tensor, density), generator=generator)
    return tensor * mask / density


def elect_and_merge(stack: torch.Tensor, coeffs: torch.Tensor, sign_method: str) -> torch.Tensor:
    """TIES' elect + disjoint merge of the stacked (pruned) tensors ``stack`` (n, ...).

    The elected sign per entry is that of ``sum_i stack_i`` (``total``) or of
    ``sum_i sgn(stack_i)`` (``frequency``), a tie counting as +; the result is the sum of
    ``coeffs_i * stack_i`` over the tensors whose sign equals the elected one, divided by their
    count (at least 1). Zeros have no sign and never count.
    """
    signs = stack.sign()
    votes = stack.sum(0) if sign_method == "total" else signs.sum(0)
    elected = torch.where(votes >= 0, 1.0, -1.0).to(stack.dtype)
    agree = (signs == elected).to(stack.dtype)  # (n, ...)
    weighted = stack * coeffs.view(-1, *([1] * (stack.dim() - 1)))
    return (weighted * agree).sum(0) / agree.sum(0).clamp(min=1.0)


def weighted_sum(stack: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
    """``sum_i coeffs_i * stack_i`` of the stacked tensors ``stack`` (n, ...)."""
    return (stack * coeffs.view(-1, *([1] * (stack.dim() - 1)))).sum(0)


class MergeRule:
    """A rule that combines one layer's LoRA pairs into one pair with scale 1; this base is
    ``linear``: each factor list summed with ``A``'s coefficients ``sgn(c_i) sqrt|c_i|`` and
    ``B``'s ``sqrt|c_i|``. A factor-wise rule changes :meth:`prune` and :meth:`merge`; a rule of
    whole deltas (``cat``, ``svd``) overrides :meth:`combine_present` and :meth:`rank`.

    Args:
        config: The rule's config (:mod:`rankwise.commands.merge.rules`).

    Attributes:
        factorwise: Combines the ``A`` s and the ``B`` s apart, so every input needs one rank.
    """

    factorwise = True

    def __init__(self, config: Any) -> None:
        self.config = config

    def rank(self, ranks: list[int]) -> int:
        """The merged rank from each input's (largest layer) rank: the common one."""
        return ranks[0]

    def prune(self, tensors: list[torch.Tensor], generator: torch.Generator | None) -> list[torch.Tensor]:
        """What each factor keeps before the merge (all of it)."""
        return tensors

    def merge(self, stack: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
        """The stacked (pruned) factors ``(n, ...)`` combined: their weighted sum."""
        return weighted_sum(stack, coeffs)

    def combine_tensors(self, tensors: list[torch.Tensor], coeffs: list[float],
                        generator: torch.Generator | None = None) -> torch.Tensor:
        """Same-shaped tensors combined: :meth:`prune`, then :meth:`merge`.

        Args:
            tensors: The tensors (all of one shape).
            coeffs: One coefficient each.
            generator: The random generator of the DARE masks.

        Returns:
            The combined tensor, in float32 for float32 inputs.
        """
        stack = torch.stack(self.prune(tensors, generator))  # (n, ...)
        return self.merge(stack, torch.tensor(coeffs, dtype=stack.dtype, device=stack.device))

    def combine(self, pairs: list[Pair | None], weights: list[float], rank: int,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Combine one layer's LoRA pairs into one pair ``(A (rank, in), B (out, rank))``, scale 1.

        Args:
            pairs: One entry per input adapter, ``None`` where that adapter leaves the layer alone
                (it then takes no part, as in PEFT).
            weights: One user weight per input adapter (negative subtracts).
            rank: The new rank (:meth:`rank`; ``cat``: a layer with fewer ranks stays
                zero-padded).
            generator: The random generator of the DARE masks.

        Returns:
            ``(A, B)`` in float32 with ``B @ A`` the combined delta.
        """
        present = [(p, w) for p, w in zip(pairs, weights) if p is not None]
        assert present, "a layer that no input adapter touches"
        return self.combine_present(present, rank, generator)

    def combine_present(self, present: list[tuple[Pair, float]], rank: int,
                        generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`combine` on the ``(pair, weight)`` of the inputs that adapt the layer."""
        coeffs = [w * p.scale for p, w in present]  # c_i = w_i * s_i
        roots = [math.sqrt(abs(c)) for c in coeffs]
        coeffs_a = [r if c >= 0 else -r for r, c in zip(roots, coeffs)]  # the sign on A only
        a = self.combine_tensors([p.a.float() for p, _ in present], coeffs_a, generator)
        b = self.combine_tensors([p.b.float() for p, _ in present], roots, generator)
        return a, b


class Ties(MergeRule):
    """``ties``: trim each factor to its top ``density``, elect signs, disjoint merge."""

    def prune(self, tensors: list[torch.Tensor], generator: torch.Generator | None) -> list[torch.Tensor]:
        """TIES' trim of every tensor."""
        return [trim(t, self.config.density) for t in tensors]

    def merge(self, stack: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
        """TIES' elect + disjoint merge (``sign_method``)."""
        return elect_and_merge(stack, coeffs, self.config.sign_method)


class DareLinear(MergeRule):
    """``dare-linear``: DARE's drop-and-rescale of every factor, then ``linear``'s sum."""

    def prune(self, tensors: list[torch.Tensor], generator: torch.Generator | None) -> list[torch.Tensor]:
        """DARE's Bernoulli mask and ``1 / density`` rescale of every tensor."""
        return [drop_and_rescale(t, self.config.density, generator) for t in tensors]


class DareTies(Ties):
    """``dare-ties``: DARE's drop-and-rescale, then TIES' elect and disjoint merge."""

    prune = DareLinear.prune


class Cat(MergeRule):
    """``cat``: the pairs side by side, ``B A = sum_i c_i B_i A_i`` exactly at rank ``sum_i r_i``."""

    factorwise = False

    def rank(self, ranks: list[int]) -> int:
        """The sum of the inputs' ranks."""
        return sum(ranks)

    def combine_present(self, present: list[tuple[Pair, float]], rank: int,
                        generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``A = [c_1 A_1; c_2 A_2; ...]`` (zero rows past the layer's ranks), ``B = [B_1, B_2, ...]``."""
        a0, b0 = present[0][0].a, present[0][0].b
        a = torch.zeros(rank, a0.shape[1], dtype=torch.float32, device=a0.device)
        b = torch.zeros(b0.shape[0], rank, dtype=torch.float32, device=b0.device)
        at = 0
        for p, w in present:
            a[at:at + p.rank] = p.a.float() * w * p.scale  # c_i A_i, rounded as PEFT rounds it
            b[:, at:at + p.rank] = p.b.float()
            at += p.rank
        return a, b


class SVD(MergeRule):
    """``svd``: the weighted sum of the deltas truncated to ``rank`` by its SVD."""

    factorwise = False

    def rank(self, ranks: list[int]) -> int:
        """The config's ``rank``, or the largest input rank."""
        return self.config.rank or max(ranks)

    def combine_present(self, present: list[tuple[Pair, float]], rank: int,
                        generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``D = sum_i w_i s_i B_i A_i ~ U_k S_k V_k^T``: ``B = U_k S_k``, ``A = V_k^T``."""
        deltas = [(p.b.float() @ p.a.float()) * p.scale for p, _ in present]  # (out, in) each
        delta = self.combine_tensors(deltas, [w for _, w in present])  # the weighted sum
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)  # delta (out, in)
        return vh[:rank].contiguous(), (u[:, :rank] * s[:rank]).contiguous()


__all__ = ["Cat", "DareLinear", "DareTies", "MergeRule", "Pair", "SIGN_METHODS", "SVD", "Ties",
           "drop_and_rescale", "elect_and_merge", "trim", "weighted_sum"]
