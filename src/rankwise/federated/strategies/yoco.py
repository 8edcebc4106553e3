"""YOCO: one-shot federated LoRA (Xu et al., NeurIPS 2025, OpenReview FoVF3iL6o3)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from rankwise.configs import bounded
from rankwise.core.protocol import adapter_modules, factors
from rankwise.core.weights import dense_weight
from rankwise.federated import keys
from rankwise.federated.strategies.base import AdapterStrategy, Plan, Update
from rankwise.federated.strategies.client_hooks import LossHook
from rankwise.federated.strategies.lora_avg import average_present


@dataclass
class YocoConfig:
    """YOCO settings (the paper's appendix values were not available; these are our choices).

    Attributes:
        name: Registry name.
        sign_weight: Weight of ``R_sign = ||tanh(gamma B) - B_s||_F / (||B_s||_F + eps)``.
        gamma_max: gamma follows a cosine ramp from 1 to ``gamma_max`` over local training.
        sparse_weight: lambda of the paper's ``R_sparse = lambda ||A||_1``, the entrywise sum
            of absolute values over every trained A, so each entry's gradient is
            ``lambda sign(A)`` (0.01: the lower end of the authors' code's regulariser weight,
            which decays from 0.1 to 0.01).
        pca_components: k of the principal-component aggregation of A (capped at #clients).
        steps_multiplier: Local steps = ``federated.local_steps * rounds * steps_multiplier``,
            so one-shot training spends as much local compute as the multi-round methods.
    """

    name: str = "yoco"
    sign_weight: float = bounded(0.1, ge=0)
    gamma_max: float = 200.0
    sparse_weight: float = bounded(0.01, ge=0)
    pca_components: int = bounded(2, ge=1)
    steps_multiplier: float = 1.0


def pca_aggregate(mats: list[torch.Tensor], weights: list[float], k: int) -> torch.Tensor:
    """Principal-component-weighted aggregation of one A matrix over clients.

    Our reading of YOCO Sec. 3 (the formula was not available): stack the flattened client
    matrices as rows of ``A'`` (N, D); take the top-k right singular vectors ``P`` (k, D) of
    the uncentred ``A'``; project every client ``Z_i = vec(A_i) P^T``; average ``Z_g =
    sum_i w_i Z_i / sum_i w_i``; map back ``A_g = Z_g P``. This is the weighted mean projected
    onto the subspace shared by the clients; with k >= rank(A') it equals the weighted mean.

    Args:
        mats: One matrix per client, same shape.
        weights: Client weights.
        k: Number of principal components.

    Returns:
        The aggregated matrix, shaped like the inputs.
    """
    flat = torch.stack([m.double().reshape(-1) for m in mats])  # (N, D)
    _, _, vh = torch.linalg.svd(flat, full_matrices=False)     # vh: (min(N, D), D)
    p = vh[: min(k, vh.shape[0])]                               # (k, D)
    w = torch.tensor(weights, dtype=torch.float64)
    z_g = (w[:, None] * (flat @ p.T)).sum(0) / w.sum()         # (k,)
    return (z_g @ p).reshape(mats[0].shape).float()


def weight_svd(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, S)`` of the layer's base weight ``W = U S V^T``, the same bits in every process.

    The server and every client compute it (B's initial value, the sign targets) and compare
    the initial adapter's fingerprint, while Ray's client processes run on one thread and the
    server on several: so the decomposition runs in float64 on one thread, and each column of
    ``U`` is given the sign that makes its largest-magnitude entry positive (an SVD's columns
    are defined up to sign).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        u, sv, _ = torch.linalg.svd(dense_weight(module).detach().double(), full_matrices=False)
    finally:
        torch.set_num_threads(threads)
    flip = torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True)))   # (1, k)
    return u * flip, sv


def sign_targets(model: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """YOCO's ``B_s = sign(U_r)`` for every factor B, from the SVD ``W = U S V^T`` of the frozen
    base weight of its layer (identical on every client).

    Args:
        model: A model of a factorized method (factors found through the adapter protocol).

    Returns:
        ``[(B (out, r), B_s (out, r))]`` in layer order.
    """
    out = []
    for _, mod in adapter_modules(model):
        for name in mod.adapter_names():
            pair = factors(mod, name)
            if pair is None:
                continue
            b = pair[1]                                               # (out, r)
            u, _ = weight_svd(mod)
            out.append((b, torch.sign(u[:, : b.shape[1]]).float().to(b.device)))
    return out


def gamma_at(local_step: int, steps: int, gamma_max: float) -> float:
    """gamma's cosine ramp from 1 (first local step) to ``gamma_max`` (last local step)."""
    return 1 + (gamma_max - 1) * 0.5 * (1 - math.cos(math.pi * local_step / max(steps - 1, 1)))


class Yoco(AdapterStrategy):
    """YOCO (Xu et al. 2025): a single round. Clients train with ``L_task + R_sign(B) +
    R_sparse(A)`` (eq. for the local objective, Sec. 3.2; the sign target ``B_s = sign(U_r)``
    comes from the SVD ``W = U S V^T`` of each adapted weight, identical on every client);
    the server averages B and aggregates A by :func:`pca_aggregate` (Sec. 3.3).

    Initialisation (:meth:`initial_tensors`): the paper builds rank-r factors from the SVD of
    each pre-trained ``W``, ``B0 = U_r S_r^{1/2}``, ``A0 = S_r^{1/2} V_r^T`` (the authors'
    ``get_low_rank_sign``), with ``B_s = sign(B0)``. Our reading: B starts at ``B0`` and A at 0,
    so the global model starts at the base model (the paper does not say that W is reduced by
    ``B0 A0``; keeping A0 without reducing W would double W's top-r part, and the released code
    sets only B, leaving a random A that shifts the model) and the sign term starts near its
    minimum rather than at its maximum (``tanh(0) = 0`` for B = 0).
    """

    name = "yoco"
    needs_factors = True

    @classmethod
    def loss_hooks(cls, model: nn.Module, roles: Mapping[str, str], config: Mapping[str, Any],
                   first_step: int, steps: int) -> dict[str, LossHook]:
        """The one-shot phase's regularisers (Sec. 3.2), as engine loss hooks:

        * ``yoco_sign``: ``w_sign * mean_B ||tanh(gamma B) - B_s||_F / (||B_s||_F + 1e-6)``
          over every factor B, gamma following :func:`gamma_at` over the local steps;
        * ``yoco_sparse``: ``lambda * sum_A ||A||_1`` (entrywise) over the factors A that train,
          so the per-entry gradient is ``lambda sign(A)``.

        Returns:
            The hooks (empty outside the ``oneshot`` phase; a term without factors is left out).
        """
        if config.get(keys.PHASE) != "oneshot":
            return {}
        signs = sign_targets(model)
        a_params = [p for n, p in model.named_parameters() if roles.get(n) == "A" and p.requires_grad]
        w_sign = float(config.get(keys.YOCO_SIGN_WEIGHT, YocoConfig.sign_weight))
        w_sparse = float(config.get(keys.YOCO_SPARSE_WEIGHT, YocoConfig.sparse_weight))
        gamma_max = float(config.get(keys.YOCO_GAMMA_MAX, YocoConfig.gamma_max))

        def sign(_model: nn.Module, step: int) -> torch.Tensor:
            gamma = gamma_at(step - first_step, steps, gamma_max)
            terms = [torch.linalg.norm(torch.tanh(gamma * b) - s) / (torch.linalg.norm(s) + 1e-6)
                     for b, s in signs]
            return w_sign * torch.stack(terms).mean()

        def sparse(_model: nn.Module, step: int) -> torch.Tensor:
            return w_sparse * torch.stack([a.abs().sum() for a in a_params]).sum()

        hooks: dict[str, LossHook] = {}
        if signs:
            hooks["yoco_sign"] = sign
        if a_params:
            hooks["yoco_sparse"] = sparse
        return hooks

    @classmethod
    def initial_tensors(cls, model: nn.Module, state: dict[str, torch.Tensor],
                        roles: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """B = ``U_r S_r^{1/2}`` from the SVD of its layer's base weight, A = 0 (see the class
        docstring); every other tensor as prepared.

        Args:
            model: The server's freshly prepared model.
            state: Its exchangeable tensors by name.
            roles: ``{name: "A" | "B"}`` of the factors among them.

        Returns:
            The initial global tensors.
        """
        out = dict(state)
        name_of = {id(p): n for n, p in model.named_parameters()}
        for _, mod in adapter_modules(model):
            for adapter in mod.adapter_names():
                pair = factors(mod, adapter)
                if pair is None:
                    continue
                a, b = (name_of.get(id(p)) for p in pair)
                if roles.get(a) != "A" or roles.get(b) != "B" or a not in out or b not in out:
                    continue
                r = out[b].shape[1]
                u, sv = weight_svd(mod)
                out[b] = (u[:, :r] * sv[:r].sqrt()).to(out[b].dtype)               # (out, r)
                out[a] = torch.zeros_like(out[a])                                   # (r, in)
        return out

    def num_rounds(self, requested: int) -> int:
        """Always one round."""
        return 1

    def plan(self, server_round: int, node_id: int) -> Plan:
        """One-shot local training with the YOCO regularisers."""
        steps = max(1, round(self.fed.local_steps * self.fed.rounds * self.config.steps_multiplier))
        return Plan(phase="oneshot", extra={
            keys.TRAIN_STEPS: steps, keys.YOCO_SIGN_WEIGHT: self.config.sign_weight,
            keys.YOCO_GAMMA_MAX: self.config.gamma_max, keys.YOCO_SPARSE_WEIGHT: self.config.sparse_weight})

    def aggregate_updates(self, server_round: int, updates: list[Update]) -> list[str]:
        """B and other tensors: weighted mean; A: PCA-weighted aggregation."""
        new = average_present(updates)
        w = [u.weight for u in updates]
        for k in new:
            if self.roles.get(k) == "A":
                new[k] = pca_aggregate([u.state[k] for u in updates], w, self.config.pca_components)
        self.global_state.update(new)
        return list(new)
