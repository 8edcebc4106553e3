"""Momentum methods on the fixed-rank manifold for factorized ``U S V^T`` layers."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from rankwise.core.protocol import adapter_modules
from rankwise.errors import RankwiseError
from rankwise.optim.common import FlaggedGroupsAdamW, next_step
from rankwise.optim.lowrank import geometry as geo
from rankwise.optim.lowrank.config import LowRankAdamConfig, LowRankHBConfig

_BLOCKS = ("core", "u", "v")


def _get(state: dict, key: str) -> geo.Tangent:
    return tuple(state[f"{key}_{b}"] for b in _BLOCKS)  # type: ignore[return-value]


def _put(state: dict, key: str, t: geo.Tangent) -> None:
    for b, x in zip(_BLOCKS, t):
        state[f"{key}_{b}"] = x.contiguous()


def _zeros(u: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> geo.Tangent:
    return torch.zeros_like(s), torch.zeros_like(u), torch.zeros_like(v)


class LowRankMomentum(FlaggedGroupsAdamW):
    """Heavy-ball (``adam=False``) or Adam (``adam=True``) on the manifold of rank-``r``
    matrices, for layers ``W = U S V^T`` (Schotthoefer, Klein, Kusch; NeurIPS 2025,
    "A geometric framework for momentum-based optimizers for low-rank training").

    The paper's update rules were not available to us (only its abstract and summaries: tangent
    space projections, basis augmentation with rank truncation, momentum). Our reading, per
    factorized layer and step, with ``P_T`` the projection onto the tangent space at the current
    point and every tangent vector kept in factored form (:mod:`.geometry`):

    1. ``g = P_T(G)`` from the factors' gradients (:func:`geometry.riemannian_gradient`);
    2. heavy ball: ``xi <- beta xi + g`` (``xi`` is the momentum, already transported to this
       point); Adam: ``m <- beta1 m + (1 - beta1) g`` on the tangent vector and
       ``v <- beta2 v + (1 - beta2) ||g||^2`` with ``||g||`` its Riemannian (Frobenius) norm,
       ``xi = m_hat / (sqrt(v_hat / d) + eps)`` with ``d = r^2 + (m + n) r``, so ``xi``'s RMS is
       about 1 as Adam's is. The second moment is one scalar per layer, as in Riemannian Adam
       (Becigneul & Ganea, ICLR 2019): element-wise moments would depend on the basis, which the
       manifold does not fix (and which a rotation of ``U``, ``V`` with equal singular values
       changes freely);
    3. decoupled decay ``S <- (1 - lr wd) S``; retraction ``W' = R(W - lr xi)``: augment the
       bases with the step's directions and truncate the rank-``2r`` result back to ``r`` by
       an SVD of its ``2r x 2r`` core (:func:`geometry.retract`);
    4. transport the momentum (Adam's first moment) to ``T(W')`` by projection
       (:func:`geometry.transport`) - the basis changed, so the momentum is re-expressed in the
       new one instead of being reused in stale coordinates.

    Plain momentum on the factors ignores that ``(U, S, V)`` and ``(U Q, Q^T S Q, V Q)``
    are the same weight, so its steps depend on the parametrization; this one acts on ``W``.
    Every step assumes ``U``, ``V`` orthonormal and ``S`` diagonal (the layer's initialisation
    and every retraction leave them so; it is checked when a layer has no moments yet); a layer
    found otherwise (trained by another optimizer, edited) is re-factorized without changing
    ``W`` and that step's gradient is skipped. Groups without ``"lowrank": True`` are AdamW.

    State per layer (kept on its ``U``): heavy ball ``mom_core``, ``mom_u``, ``mom_v``
    (``r^2 + (m + n) r``); Adam ``exp_avg_core``, ``exp_avg_u``, ``exp_avg_v`` (the same) and
    the 0-dim ``exp_avg_sq``.

    Args:
        params: Param groups; a low-rank group holds exactly ``[U, S, V]`` of one layer.
        lr: Step size of the low-rank groups (and default of the others).
        momentum: Heavy-ball ``beta``.
        betas: Adam's betas (Adam mode and the AdamW groups).
        eps: Adam's epsilon.
        weight_decay: Decoupled weight decay.
        adam: Adam instead of heavy ball on the low-rank groups.

    Raises:
        RankwiseError: If a low-rank group does not hold three factors ``(m, r), (r, r), (n, r)``.
    """

    group_flag = "lowrank"

    def __init__(self, params: Iterable[dict[str, Any]], lr: float = 1e-3, momentum: float = 0.9,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adam: bool = False) -> None:
        defaults = dict(lr=lr, momentum=momentum, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, adam=adam, lowrank=False)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["lowrank"]:
                shapes = [tuple(p.shape) for p in group["params"]]
                if len(shapes) != 3 or shapes[1] != (shapes[0][1],) * 2 or shapes[2][1] != shapes[0][1]:
                    raise RankwiseError(f"a low-rank group needs [U (m, r), S (r, r), V (n, r)]; got {shapes}")

    def group_step(self, group: dict) -> None:
        """One step of a factorized layer's ``[U, S, V]`` (see the class docstring)."""
        u_p, s_p, v_p = group["params"]
        if u_p.grad is None or s_p.grad is None or v_p.grad is None:
            return
        state = self.state[u_p]
        step = next_step(state)
        u, s, v = u_p.float(), s_p.float(), v_p.float()
        rank = s.shape[0]
        fresh = "mom_core" not in state and "exp_avg_core" not in state
        if fresh and not _canonical_form(u, s, v):
            # Trained by another optimizer or edited: re-factorize (same W), restart the
            # moments, and skip this gradient, which was taken in the old parametrization.
            u_new, s_new, v_new = geo.retract(u, s, v, _zeros(u, s, v), 0.0, rank)
            for key in [k for k in state if k != "step"]:
                del state[key]
            u_p.copy_(u_new)
            s_p.copy_(s_new)
            v_p.copy_(v_new)
            return
        g = geo.riemannian_gradient(u, s, v, u_p.grad.float(), s_p.grad.float(), v_p.grad.float())
        lr = group["lr"]
        if group["adam"]:
            beta1, beta2 = group["betas"]
            m = _get(state, "exp_avg") if "exp_avg_core" in state else _zeros(u, s, v)
            m = tuple(a.mul(beta1).add_(b, alpha=1 - beta1) for a, b in zip(m, g))
            sq = state.get("exp_avg_sq", torch.zeros((), dtype=u.dtype, device=u.device))
            sq = sq * beta2 + (1 - beta2) * sum(b.square().sum() for b in g)    # ||g||^2
            dim = geo.tangent_numel((u.shape[0], v.shape[0]), rank)
            denom = (sq / (1 - beta2 ** step) / dim).sqrt() + group["eps"]      # RMS of g
            xi = tuple(a / (1 - beta1 ** step) / denom for a in m)
        else:
            mom = _get(state, "mom") if "mom_core" in state else _zeros(u, s, v)
            xi = tuple(a.mul(group["momentum"]).add_(b) for a, b in zip(mom, g))
        s = s * (1 - lr * group["weight_decay"])
        new_u, new_s, new_v = geo.retract(u, s, v, xi, lr, rank)
        if group["adam"]:
            _put(state, "exp_avg", geo.transport(u, v, new_u, new_v, m))
            state["exp_avg_sq"] = sq
        else:
            _put(state, "mom", geo.transport(u, v, new_u, new_v, xi))
        u_p.copy_(new_u)
        s_p.copy_(new_s)
        v_p.copy_(new_v)


def _canonical_form(u: torch.Tensor, s: torch.Tensor, v: torch.Tensor, tol: float = 1e-4) -> bool:
    """True when ``U``, ``V`` are orthonormal and ``S`` diagonal (to ``tol``): the invariant
    the layer's initialisation and every retraction establish."""
    eye = torch.eye(s.shape[0], dtype=u.dtype, device=u.device)
    off = s - torch.diag(torch.diagonal(s))
    return bool((u.T @ u - eye).abs().max() < tol and (v.T @ v - eye).abs().max() < tol
                and off.abs().max() <= tol * s.abs().max().clamp_min(1e-30))


def lowrank_param_groups(model: nn.Module, head_lr: float | None) -> list[dict]:
    """One ``lowrank`` group ``[U, S, V]`` per active, trainable factorization (found through
    the adapter protocol's ``lowrank_factors`` capability), and one AdamW group (``head_lr``)
    for every other trainable parameter.

    Args:
        model: The model (adapted by ``lowrank``).
        head_lr: The AdamW group's learning rate (``None``: the optimizer's ``lr``).

    Returns:
        Non-empty param-group dicts.

    Raises:
        RankwiseError: If the model has no trainable low-rank factorization.
    """
    groups, ids = [], set()
    for _, mod in adapter_modules(model):
        fn = getattr(mod, "lowrank_factors", None)
        if not callable(fn):
            continue
        for name in mod.active_names():
            factors = list(fn(name))
            if all(p.requires_grad for p in factors):
                groups.append({"params": factors, "lowrank": True})
                ids.update(id(p) for p in factors)
    if not groups:
        raise RankwiseError("lowrank-hb / lowrank-adam need factorized layers: set method.name: lowrank")
    rest = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad and id(p) not in ids]
    if rest:
        groups.insert(0, {"params": rest} if head_lr is None else {"params": rest, "lr": head_lr})
    return groups


def build_lowrank_hb(model: nn.Module, config: LowRankHBConfig) -> LowRankMomentum:
    """Registry builder for ``lowrank-hb``.

    Args:
        model: A model adapted by the ``lowrank`` method.
        config: The ``optim:`` section.

    Returns:
        Heavy ball on the factorized layers, AdamW (``head_lr``) on the rest.
    """
    return LowRankMomentum(lowrank_param_groups(model, config.head_lr), lr=config.lr,
                           momentum=config.momentum, betas=config.betas, eps=config.eps,
                           weight_decay=config.weight_decay, adam=False)


def build_lowrank_adam(model: nn.Module, config: LowRankAdamConfig) -> LowRankMomentum:
    """Registry builder for ``lowrank-adam``.

    Args:
        model: A model adapted by the ``lowrank`` method.
        config: The ``optim:`` section.

    Returns:
        Riemannian Adam on the factorized layers, AdamW on the rest.
    """
    return LowRankMomentum(lowrank_param_groups(model, config.head_lr), lr=config.lr,
                           betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
                           adam=True)


def _state_floats(tangents: int) -> Callable[[nn.Module, Any], int]:
    def state_floats(model: nn.Module, config: Any) -> int:
        total = 0
        for group in lowrank_param_groups(model, getattr(config, "head_lr", None)):
            if group.get("lowrank"):
                u, s, v = group["params"]
                total += tangents * geo.tangent_numel((u.shape[0], v.shape[0]), s.shape[0])
            else:
                total += 2 * sum(p.numel() for p in group["params"])
        return total
    return state_floats


lowrank_hb_state_floats = _state_floats(1)
lowrank_adam_state_floats = _state_floats(1)   # plus one 0-dim second moment per layer
