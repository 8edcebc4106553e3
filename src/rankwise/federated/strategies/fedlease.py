"""FedLEASE: federated adaptive LoRA expert allocation and selection (Wang, Bian, Zhang, Xu;
NeurIPS 2025, arXiv 2509.15087). No official code was found; choices are documented below."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from rankwise.federated import keys
from rankwise.federated.moe import (cluster_key, expert_key, is_expert_key, is_moe,
                                    moe_wire_parameters, router_key, to_moe, trains_in_cluster)
from rankwise.federated.strategies.base import AdapterStrategy, Plan, Update
from rankwise.federated.strategies.lora_avg import average_present

LOG = logging.getLogger("rankwise.federated")


@dataclass
class FedLeaseConfig:
    """FedLEASE settings.

    Attributes:
        name: Registry name.
        max_experts: Largest number of clusters/experts M tried (the reimplementations use 8).
        top_m: Router slots kept per token; ``0`` means M (the paper's adaptive top-M).
    """

    name: str = "fedlease"
    max_experts: int = 4
    top_m: int = 0

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings."""
        return [] if self.max_experts >= 1 else [
            f"max_experts: got {self.max_experts}; expected an integer >= 1"]


def b_distance(states: list[dict[str, torch.Tensor]], roles: Mapping[str, str]) -> torch.Tensor:
    """``d(i, j) = mean_l (1 - cos(vec B_i^l, vec B_j^l))`` over the factors B.

    Args:
        states: One adapter per client.
        roles: ``{name: "A" | "B"}`` of the factors (the B matrices are those with role B).

    Returns:
        A symmetric (N, N) distance matrix with zero diagonal.
    """
    names = [k for k in states[0] if roles.get(k) == "B"]
    n = len(states)
    d = torch.zeros(n, n, dtype=torch.float64)
    for k in names:
        v = torch.stack([s[k].double().reshape(-1) for s in states])     # (N, D)
        v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-12)
        d += 1.0 - v @ v.T
    d = d / max(len(names), 1)
    d.fill_diagonal_(0.0)
    return d.clamp_min(0.0)


def silhouette(d: torch.Tensor, labels: list[int]) -> float:
    """Mean silhouette ``(b - a) / max(a, b)`` over points (0 for points alone in a cluster).

    Args:
        d: (N, N) distances.
        labels: Cluster of each point.

    Returns:
        The mean silhouette score in [-1, 1].
    """
    n = len(labels)
    scores = []
    for i in range(n):
        same = [j for j in range(n) if labels[j] == labels[i] and j != i]
        if not same:
            scores.append(0.0)
            continue
        a = float(d[i, same].mean())
        b = min(float(d[i, [j for j in range(n) if labels[j] == c]].mean())
                for c in set(labels) if c != labels[i])
        scores.append((b - a) / max(a, b) if max(a, b) > 0 else 0.0)
    return sum(scores) / n


def cluster_clients(d: torch.Tensor, max_k: int) -> tuple[list[int], dict[int, float]]:
    """Average-linkage agglomerative clustering, k = argmax silhouette over 2..min(max_k, N-1).

    Args:
        d: (N, N) distances.
        max_k: Largest k tried.

    Returns:
        ``(labels 0..k-1 in order of first appearance, {k: silhouette})``; one cluster when
        N < 3 or ``max_k`` < 2.
    """
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform
    n = d.shape[0]
    if n < 3 or max_k < 2:
        return [0] * n, {}
    tree = linkage(squareform(d.numpy(), checks=False), method="average")
    scores, best = {}, None
    for k in range(2, min(max_k, n - 1) + 1):
        raw = fcluster(tree, t=k, criterion="maxclust").tolist()
        scores[k] = silhouette(d, raw)
        if best is None or scores[k] > scores[best[0]] + 1e-12:
            best = (k, raw)
    first: dict[int, int] = {}
    labels = [first.setdefault(c, len(first)) for c in best[1]]
    return labels, scores


class FedLease(AdapterStrategy):
    """FedLEASE (Wang et al. 2025). Round 1 is the warm-up: every client trains a plain LoRA
    and sends A and B. The server clusters clients by the cosine distance of their B matrices
    (Sec. 3.2; M chosen by silhouette), initialises one expert per cluster as the mean of its
    members' (A, B), and from round 2 each client trains only its own expert, its cluster's
    router and head, with the other experts frozen in the forward (adaptive top-M, Sec. 3.3);
    the server averages within each cluster, weighted by examples.

    Choices (not in the available text): average linkage; routers and heads are shared per
    cluster (averaged with the expert), zero-initialised routers; the warm-up samples every
    connected client; a client first seen after clustering joins cluster 0 (logged).
    """

    name = "fedlease"
    needs_factors = True
    STRUCTURE = (keys.CLUSTER, keys.NUM_EXPERTS, keys.TOP_M)

    # ----- client side ------------------------------------------------------------------------
    @classmethod
    def model_structure(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """After clustering: the client's cluster, M and top-M (they define its mixture)."""
        return {k: config[k] for k in cls.STRUCTURE} if keys.CLUSTER in config else {}

    @classmethod
    def prepare_model(cls, model: nn.Module, config: Mapping[str, Any]) -> None:
        """Turn the plain LoRA model into the cluster's mixture (once)."""
        if keys.CLUSTER in config and not is_moe(model):
            to_moe(model, int(config[keys.NUM_EXPERTS]), int(config[keys.CLUSTER]), int(config[keys.TOP_M]))

    @classmethod
    def wire_parameters(cls, model: nn.Module) -> dict[str, nn.Parameter]:
        """Expert/cluster wire names once the model is a mixture (:mod:`rankwise.federated.moe`)."""
        return moe_wire_parameters(model) if is_moe(model) else super().wire_parameters(model)

    @classmethod
    def train_names(cls, names: list[str], roles: Mapping[str, str],
                    config: Mapping[str, Any]) -> list[str]:
        """After clustering a client trains only its own expert, its cluster's routers and head."""
        if keys.CLUSTER not in config:
            return super().train_names(names, roles, config)
        return [n for n in names if trains_in_cluster(n, int(config[keys.CLUSTER]))]

    # ----- server side ------------------------------------------------------------------------
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cluster: dict[int, int] = {}
        self.num_experts = 0
        self.silhouettes: dict[int, float] = {}
        self._cluster_of_partition: dict[str, int] = {}  # a restored run's clusters (extra_state)

    def extra_state(self) -> dict[str, Any]:
        """Clusters by data partition, the expert count and the silhouettes."""
        by_partition = {str(self.partition_of[n]): c for n, c in self.cluster.items() if n in self.partition_of}
        by_partition.update(self._cluster_of_partition)
        return {"cluster_of_partition": by_partition, "num_experts": self.num_experts,
                "silhouettes": {str(k): v for k, v in self.silhouettes.items()}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Clusters come back by partition; each new node joins its partition's cluster once it
        has identified itself (:meth:`_adopt`)."""
        self._cluster_of_partition = {k: int(c) for k, c in state.get("cluster_of_partition", {}).items()}
        self.num_experts = int(state.get("num_experts", 0))
        self.silhouettes = {int(k): float(v) for k, v in state.get("silhouettes", {}).items()}

    def _adopt(self) -> None:
        """Put identified nodes of a restored run into their partition's cluster."""
        for node, part in self.partition_of.items():
            c = self._cluster_of_partition.get(str(part))
            if c is not None and node not in self.cluster:
                self.cluster[node] = c

    def _sample(self, grid) -> list[int]:
        if not self.cluster and not self._cluster_of_partition:  # warm-up: everyone
            return self.connected(grid)
        nodes = super()._sample(grid)
        self._adopt()
        return nodes

    def _extra(self, c: int) -> dict:
        return {keys.CLUSTER: c, keys.NUM_EXPERTS: self.num_experts,
                keys.TOP_M: self.config.top_m or self.num_experts}

    def plan(self, server_round: int, node_id: int) -> Plan:
        """Warm-up before clustering, then own-expert training."""
        if not self.cluster:
            return Plan(phase="warmup")
        if node_id not in self.cluster:
            LOG.warning("FedLEASE: node %d joined after clustering; assigned to cluster 0", node_id)
            self.cluster[node_id] = 0
        return Plan(extra=self._extra(self.cluster[node_id]))

    def payload_keys(self, node_id: int, plan: Plan) -> list[str]:
        """All experts, plus the node's cluster router and head."""
        if keys.CLUSTER not in plan.extra:
            return list(self.global_state)
        own = keys.CLUSTER_PREFIX.format(c=plan.extra[keys.CLUSTER])
        return [k for k in self.global_state if is_expert_key(k) or k.startswith(own)]

    def expected(self, node_id: int, plan: Plan) -> dict[str, tuple]:
        """Warm-up: the plain adapter; later: own expert, router and head."""
        if keys.CLUSTER not in plan.extra:
            return super().expected(node_id, plan)
        c = int(plan.extra[keys.CLUSTER])
        return {k: tuple(v.shape) for k, v in self.global_state.items() if trains_in_cluster(k, c)}

    def aggregate_updates(self, server_round: int, updates: list[Update]) -> list[str]:
        """Cluster after the warm-up; afterwards average within clusters (keys are disjoint)."""
        if self.cluster:
            new = average_present(updates)
            self.global_state.update(new)
            return list(new)
        self.cluster = self.cluster_updates(updates)
        self.num_experts = max(self.cluster.values()) + 1
        routers = self._router_shapes()
        new: dict[str, torch.Tensor] = {}
        for c in range(self.num_experts):
            members = [u for u in updates if self.cluster[u.node_id] == c]
            for k, v in average_present(members).items():
                new[expert_key(c, k) if k in self.roles else cluster_key(c, k)] = v
            for a_name, shape in routers.items():
                new[router_key(c, a_name)] = torch.zeros(shape)
        self.global_state = new
        return list(new)

    def cluster_updates(self, updates: list[Update]) -> dict[int, int]:
        """Clustering hook (Sec. 3.2): ``{node id: cluster}`` from the warm-up adapters, by the
        cosine distance of their B factors; M by silhouette (kept in ``self.silhouettes``)."""
        d = b_distance([u.state for u in updates], self.roles)
        labels, self.silhouettes = cluster_clients(d, self.config.max_experts)
        cluster = {u.node_id: c for u, c in zip(updates, labels)}
        LOG.info("FedLEASE: %d experts; clusters %s; silhouettes %s", max(labels) + 1, cluster,
                 self.silhouettes)
        return cluster

    def _router_shapes(self) -> dict[str, tuple[int, int]]:
        """Router shape (2M-1, d_in) per layer, keyed by the layer's A factor (r, d_in)."""
        return {k: (2 * self.num_experts - 1, v.shape[1]) for k, v in self.global_state.items()
                if self.roles.get(k) == "A"}

    def run_metrics(self) -> dict[str, Any]:
        """The number of experts and the silhouette of every k tried."""
        if not self.silhouettes:
            return {}
        return {"fedlease_experts": self.num_experts,
                "fedlease_silhouettes": {str(k): round(v, 4) for k, v in self.silhouettes.items()}}

    def eval_views(self):
        """Before clustering: the plain adapter on all data; after: one MoE model per cluster,
        evaluated on the examples of its members' partitions."""
        if not self.cluster:
            return [(self.global_state, {}, None)]
        views = []
        for c in range(self.num_experts):
            parts = {self.partition_of[n] for n, cc in self.cluster.items()
                     if cc == c and n in self.partition_of}
            state = {k: v for k, v in self.global_state.items()
                     if is_expert_key(k) or k.startswith(keys.CLUSTER_PREFIX.format(c=c))}
            views.append((state, self._extra(c), parts))
        return views
