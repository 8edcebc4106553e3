"""FedLEASE: federated adaptive LoRA expert allocation and selection (Wang, Bian, Zhang, Xu;
NeurIPS 2025, arXiv 2509.15087). No official code was found; choices are documented below."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rankwise.federated import keys
from rankwise.federated.moe import cluster_key, expert_key, is_expert_key
from rankwise.federated.payload import is_factor
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


def b_distance(states: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """``d(i, j) = mean_l (1 - cos(vec B_i^l, vec B_j^l))`` over the LoRA B matrices.

    Args:
        states: One adapter per client.

    Returns:
        A symmetric (N, N) distance matrix with zero diagonal.
    """
    names = [k for k in states[0] if is_factor(k, "B")]
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

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cluster: dict[int, int] = {}
        self.num_experts = 0
        self.silhouettes: dict[int, float] = {}

    def _sample(self, grid) -> list[int]:
        if not self.cluster:  # warm-up: everyone (after at least min_clients connected)
            from flwr.serverapp.strategy.strategy_utils import sample_nodes
            sample_nodes(grid, self.fed.min_clients, self.fed.min_clients)
            return sorted(grid.get_node_ids())
        return super()._sample(grid)

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
        c = plan.extra[keys.CLUSTER]
        prefixes = (keys.EXPERT_PREFIX.format(m=c), keys.CLUSTER_PREFIX.format(c=c))
        return {k: tuple(v.shape) for k, v in self.global_state.items() if k.startswith(prefixes)}

    def aggregate_updates(self, server_round: int, updates: list[Update]) -> list[str]:
        """Cluster after the warm-up; afterwards average within clusters (keys are disjoint)."""
        if self.cluster:
            new = average_present(updates)
            self.global_state.update(new)
            return list(new)
        d = b_distance([u.state for u in updates])
        labels, self.silhouettes = cluster_clients(d, self.config.max_experts)
        self.num_experts = max(labels) + 1
        self.cluster = {u.node_id: c for u, c in zip(updates, labels)}
        LOG.info("FedLEASE: %d experts; clusters %s; silhouettes %s", self.num_experts,
                 self.cluster, self.silhouettes)
        routers = self._router_shapes()
        new: dict[str, torch.Tensor] = {}
        for c in range(self.num_experts):
            members = [u for u in updates if self.cluster[u.node_id] == c]
            mean = average_present(members)
            for k, v in mean.items():
                new[expert_key(c, k) if is_factor(k, "A") or is_factor(k, "B") else cluster_key(c, k)] = v
            for path, shape in routers.items():
                new[cluster_key(c, f"{path}.router.weight")] = torch.zeros(shape)
        self.global_state = new
        return list(new)

    def _router_shapes(self) -> dict[str, tuple[int, int]]:
        """Router shape (2M-1, d_in) per LoRA layer path, read off the A matrices."""
        out = {}
        for k, v in self.global_state.items():
            if is_factor(k, "A"):
                path = k.split(".lora_A.")[0]
                out[path] = (2 * self.num_experts - 1, v.shape[1])
        return out

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
