"""Pieces every low-rank optimizer shares: which parameters are projected, the one AdamW body the
matrix optimizers extend (:class:`MatrixAdamW`), the step skeleton of the optimizers that run
their own rule on some groups and AdamW on the rest (:class:`FlaggedGroupsAdamW`), and counting optimizer state (measured, and
predicted by a formula). Adam's arithmetic lives in :mod:`rankwise.optim.adam` and is
re-exported here.

Param groups are decided here, explicitly, in the same target language as adapters
(:mod:`rankwise.core.inject`): by default (``"block-linear"``) the 2-D weight matrices of the
linear layers inside the repeated transformer blocks go to the projected group; embeddings,
norms, biases, poolers and output heads go to a plain AdamW group (GaLore's own recipe).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Union

import torch
from torch import nn

from rankwise.core.inject import find_targets
from rankwise.core.weights import base_layer
from rankwise.optim import lowbit, projector
from rankwise.optim.adam import adam_direction, adamw_update, adamw_updates, decay_, next_step  # noqa: F401

DEFAULT_TARGETS = "block-linear"


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Return the parameters of ``model`` that require grad (deduplicated, in model order)."""
    return [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]


def split_params(model: nn.Module, targets: Union[list[str], str, None] = DEFAULT_TARGETS
                 ) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """Split the trainable parameters into (projected matrices, everything else).

    Args:
        model: Any model. Only parameters with ``requires_grad`` are returned.
        targets: Which linear layers' weights are projected, in the target language of
            :func:`rankwise.core.inject.find_targets` (``"block-linear"``, ``"all-linear"``, a
            regex over module paths, or a list of name suffixes). ``None`` = ``"block-linear"``.

    Returns:
        ``(projected, plain)``: lists of ``(parameter name, parameter)`` in model order,
        each parameter once. Projected parameters are 2-D with both sides larger than 1.

    Raises:
        RankwiseError: If explicit ``targets`` match no layer or are an invalid regex.
    """
    targets = targets or DEFAULT_TARGETS
    paths = find_targets(model, targets, what="optim.targets", allow_empty=targets == DEFAULT_TARGETS)
    chosen: set[int] = set()
    for path in paths:
        w = getattr(base_layer(model.get_submodule(path)), "weight", None)
        if w is not None and w.ndim == 2 and min(w.shape) > 1:
            chosen.add(id(w))
    projected, plain, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (projected if id(p) in chosen else plain).append((name, p))
    return projected, plain


def param_groups(model: nn.Module, targets: list[str] | None, **projected_options) -> list[dict]:
    """Two param groups: plain AdamW for non-block parameters, ``projected_options`` for the rest.

    Args:
        model: The model to train.
        targets: Which matrices are projected (see :func:`split_params`).
        **projected_options: Group options of the projected group (``rank``, ``update_every``...).

    Returns:
        The non-empty groups.
    """
    projected, plain = split_params(model, targets)
    groups = [{"params": [p for _, p in plain]},
              {"params": [p for _, p in projected], **projected_options}]
    return [g for g in groups if g["params"]]


def run_closure(closure) -> torch.Tensor | None:
    """Evaluate an optimizer ``step`` closure with gradients enabled (``None`` -> ``None``)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def step_generator(seed: int, index: int, step: int) -> torch.Generator:
    """A generator that depends only on (seed, parameter index, step), so random choices
    (sampled subspaces, stochastic rounding) are identical on every DDP process and after a
    resume, with no RNG state to save.

    Args:
        seed: The group's ``seed``.
        index: Position of the parameter in the optimizer (over all groups).
        step: 1-based step count.

    Returns:
        A freshly seeded CPU generator.
    """
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + index * 10_007 + step) % (2**63 - 1))
    return g


@dataclass(frozen=True)
class Place:
    """Where a parameter sits in its optimizer (per-parameter seeds, staggered refreshes).

    Attributes:
        index: Position among all the optimizer's parameters, over every group.
        matrix: Position among the 2-D parameters of its group.
        matrices: Number of 2-D parameters in its group.
    """

    index: int
    matrix: int
    matrices: int


class MatrixAdamW(torch.optim.Optimizer):
    """The body GaLore, SUMO and Q3R share: AdamW for every parameter, except that each 2-D
    parameter of a group that sets ``rank`` is updated by the subclass's :meth:`matrix_step`.

    Subclasses set :attr:`group_defaults` (their param-group options beyond AdamW's) and
    implement :meth:`matrix_step` (and :meth:`finish_step` to batch work across matrices). ``step`` counts every parameter's steps in its state
    (``next_step``) before calling it, as ``torch.optim.AdamW`` does.

    Args:
        params: Parameters or param-group dicts (a group with ``rank`` is a matrix group).
        lr: Default learning rate.
        betas: Default Adam betas.
        eps: Default Adam epsilon.
        weight_decay: Default decoupled weight decay.
        state_bits: Default ``state_bits`` of every group: ``None`` (float32 moments) or 8
            (Adam's moments of every parameter stored as blockwise 8-bit codes,
            :mod:`rankwise.optim.lowbit`; subclasses quantise their projected moments too).

    Raises:
        ValueError: For a group whose ``rank`` or ``update_every`` is below 1 (torch's convention).
    """

    group_defaults: ClassVar[dict[str, Any]] = {}
    # what the subclass's own update acts on, and how a run gives it something to act on (the
    # rest steps as AdamW; ``recipes/optim_scope.py`` reads these to say how far it reaches)
    own_update: ClassVar[tuple[str, str]] = (
        "trainable 2-D weight matrices of optim.targets (default: the linear layers of the "
        "transformer blocks)", "train them (method.name: full) or use optim.name: adamw")

    def updates_own_way(self, group: dict, p: torch.Tensor) -> bool:
        """Whether ``p`` of ``group`` gets the subclass's update (a 2-D matrix of a rank group)."""
        return group.get("rank") is not None and p.ndim == 2

    def keeps_full_rank(self, group: dict, p: torch.Tensor) -> bool:
        """Whether the group's rank covers ``p``'s smaller side (no rank reduction there)."""
        return self.updates_own_way(group, p) and group["rank"] >= min(p.shape)

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, state_bits: int | None = None) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        state_bits=state_bits, **self.group_defaults)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group.get("rank") is not None and (group["rank"] <= 0 or group["update_every"] < 1):
                raise ValueError(f"rank and update_every must be positive: got {group['rank']}, "
                                 f"{group['update_every']}")

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """Perform one step.

        Args:
            closure: Optional closure that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = run_closure(closure)
        index = -1
        self._adamw: list[tuple[torch.Tensor, dict, dict, int]] = []
        for group in self.param_groups:
            matrices = sum(p.ndim == 2 for p in group["params"])
            matrix = -1
            for p in group["params"]:
                index += 1
                matrix += p.ndim == 2
                if p.grad is None:
                    continue
                state = self.state[p]
                step = next_step(state)
                if group.get("rank") is None or p.ndim != 2:
                    self.defer_adamw(p, state, group, step)
                else:
                    self.matrix_step(p, state, group, step, Place(index, matrix, matrices))
        self.finish_step()
        for group in self.param_groups:   # one multi-tensor AdamW per group
            items = [it for it in self._adamw if it[2] is group]
            if group.get("state_bits"):   # 8-bit moments: one parameter at a time
                for p, st, _, step in items:
                    beta1, beta2 = group["betas"]
                    direction = lowbit.quantized_adam_direction(st, p.grad, beta1, beta2, group["eps"],
                                                                step, group["state_bits"])
                    decay_(p, group["lr"], group["weight_decay"])
                    p.add_(direction.to(p.dtype), alpha=-group["lr"])
                continue
            adamw_updates([it[0] for it in items], [it[1] for it in items], group, [it[3] for it in items])
        self._adamw = []
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, then 8-bit moment codes back to uint8 (torch casts every
        state tensor of a float parameter to the parameter's dtype; the codes are exact in it)."""
        super().load_state_dict(state_dict)
        lowbit.restore_codes(self.state.values())

    def defer_adamw(self, param: torch.Tensor, state: dict, group: dict, step: int) -> None:
        """Queue a plain AdamW update of ``param``; the queue runs after :meth:`finish_step`
        with the multi-tensor kernels (:func:`adamw_updates`)."""
        self._adamw.append((param, state, group, step))

    def finish_step(self) -> None:
        """Called once after every parameter's :meth:`matrix_step` of a step: a subclass that
        batches work across matrices (SUMO's orthogonalization) does it here."""

    def matrix_step(self, param: torch.Tensor, state: dict, group: dict, step: int,
                    place: Place) -> None:
        """Update one 2-D parameter of a matrix group from ``param.grad`` (weight decay included).

        Args:
            param: The ``m x n`` parameter (changed in place).
            state: Its optimizer state (``step`` already counted).
            group: Its param group.
            step: 1-based step count.
            place: Where it sits in the optimizer.
        """
        raise NotImplementedError


class FlaggedGroupsAdamW(torch.optim.Optimizer):
    """The step NanoAdam, t-SignSGD and the low-rank momentum methods share: a param group whose
    :attr:`group_flag` option is true is handed to the subclass's rule, every other group gets
    ``torch.optim.AdamW``'s update (:func:`adamw_update`), parameter by parameter.

    Subclasses set :attr:`group_flag` (a param-group option their ``__init__`` defaults to
    ``False``) and implement :meth:`param_step` (called for each parameter with a gradient of a
    flagged group, its ``step`` already counted) or, for a rule over a whole group (the
    ``[U, S, V]`` of a factorized layer), :meth:`group_step`; :meth:`begin_step` sees every
    group before any parameter moves (t-SignSGD's global gradient norm).
    """

    group_flag: ClassVar[str] = ""

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One step: :meth:`begin_step`, then each group by its rule.

        Args:
            closure: Optional closure re-evaluating the loss.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = run_closure(closure)
        self.begin_step()
        for group in self.param_groups:
            if group[self.group_flag]:
                self.group_step(group)
                continue
            for p in group["params"]:
                if p.grad is not None:
                    adamw_update(p, self.state[p], group, next_step(self.state[p]))
        return loss

    def begin_step(self) -> None:
        """Called once per step before any update (nothing by default)."""

    def group_step(self, group: dict) -> None:
        """Update a flagged group: :meth:`param_step` for each parameter with a gradient."""
        for p in group["params"]:
            if p.grad is not None:
                state = self.state[p]
                self.param_step(p, state, group, next_step(state))

    def param_step(self, param: torch.Tensor, state: dict, group: dict, step: int) -> None:
        """Update one parameter of a flagged group from ``param.grad``.

        Args:
            param: The parameter (changed in place).
            state: Its optimizer state (``step`` already counted).
            group: Its param group.
            step: 1-based step count.
        """
        raise NotImplementedError


def grouped_state_floats(model: nn.Module, targets: Union[list[str], str, None],
                         per_matrix: Callable[[tuple[int, int]], int], bits: int | None = None) -> float:
    """State floats a :class:`MatrixAdamW` built by :func:`param_groups` holds for ``model``
    once every trainable parameter has had a gradient.

    Args:
        model: The model.
        targets: The config's ``targets`` (see :func:`split_params`).
        per_matrix: Floats of one projected ``(m, n)`` matrix (e.g. GaLore's ``2nr + mr``).
        bits: ``state_bits`` of the plain group's moments (:func:`rankwise.optim.lowbit.moment_floats`).

    Returns:
        ``2`` per element of the plain AdamW group (less with ``bits``) plus ``per_matrix``
        over the projected group.
    """
    projected, plain = split_params(model, targets)
    return (sum(2 * lowbit.moment_floats(p.numel(), bits) for _, p in plain)
            + sum(per_matrix((p.shape[0], p.shape[1])) for _, p in projected))


def elementwise_state_floats(per_element: int) -> Callable[[nn.Module, Any], int]:
    """A registry ``state_floats`` for optimizers that keep ``per_element`` floats for every
    trainable element (AdamW: 2 moments; NGN-M: 1 displacement).

    Args:
        per_element: State floats per trainable parameter element.

    Returns:
        ``state_floats(model, config) -> int`` (the count does not depend on the config).
    """
    def state_floats(model: nn.Module, config: Any) -> int:
        return per_element * sum(p.numel() for p in trainable_parameters(model))
    return state_floats


def subspace_state_floats(moments: int) -> Callable[[nn.Module, Any], int]:
    """A registry ``state_floats`` for projected optimizers built with :func:`param_groups`:
    per projected ``m x n`` matrix, ``moments`` tensors of ``max(m,n) x r`` plus the basis,
    ``min(m,n) x r`` (GaLore, 2 moments: ``2nr + mr``; SUMO, 1: ``nr + mr``); ``moments * mn``
    where the rank covers the matrix (no basis); AdamW's 2 per element elsewhere; with
    ``state_bits: 8`` every moment costs :func:`rankwise.optim.lowbit.moment_floats`. A quantized Oja
    tracker (``projector: oja`` with ``oja_bits``) stores the basis in one byte per entry plus
    ``r`` float scales (``mr / 4 + r``, counted in 4-byte floats, so the total may be fractional).

    Args:
        moments: Moment tensors kept per projected matrix.

    Returns:
        ``state_floats(model, config) -> float``; ``config`` supplies ``rank``, ``targets`` and,
        where it has them, ``projector`` and ``oja_bits``.
    """
    def state_floats(model: nn.Module, config: Any) -> float:
        r = config.rank
        bits = getattr(config, "oja_bits", None) if getattr(config, "projector", "svd") == "oja" else None
        state_bits = getattr(config, "state_bits", None)
        return grouped_state_floats(
            model, config.targets,
            lambda shape: (moments * lowbit.moment_floats(projector.projected_numel(shape, r), state_bits)
                           + projector.basis_numel(shape, r, bits)), state_bits)
    return state_floats


def state_bytes(optimizer: torch.optim.Optimizer,
                params: Iterable[torch.Tensor] | None = None) -> int:
    """Bytes held in ``optimizer.state``, counted from the tensors themselves.

    0-dim bookkeeping tensors (step counters, orientation flags) are left out so that the count
    can be compared with the per-matrix formulas (``2nr + mr`` ...); they are a few bytes each.

    Args:
        optimizer: Any torch optimizer.
        params: Restrict the count to these parameters (default: all).

    Returns:
        Total ``numel * element_size`` of the non-scalar state tensors.
    """
    keys = None if params is None else {id(p) for p in params}
    total = 0
    for p, st in optimizer.state.items():
        if keys is not None and id(p) not in keys:
            continue
        for v in st.values():
            if torch.is_tensor(v) and v.ndim > 0:
                total += v.numel() * v.element_size()
    return total


def betas_problems(betas: list[float] | None) -> list[str]:
    """Adam's ``betas``: two numbers in [0, 1) (the scalar fields an optimizer config shares,
    ``lr``, ``weight_decay``, ``eps``, ``rank``, ``update_every``, declare their ranges with
    :func:`rankwise.configs.bounded`)."""
    if betas is not None and (len(betas) != 2 or not all(0 <= b < 1 for b in betas)):
        return [f"betas: got {list(betas)}; expected two numbers in [0, 1) such as [0.9, 0.999]"]
    return []
