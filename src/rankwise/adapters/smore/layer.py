"""S'MoRE: hierarchical residual experts routed as a tree (an ``AdapterModule``).

Zeng et al., "S'MoRE: Structural Mixture of Residual Experts for LLM Fine-tuning", NeurIPS 2025
(arXiv 2504.06426); the forward follows the authors' ``SMoREFFN`` (``hier_moe/layer.py``,
``activation_position="all"``, switch gate, ``w_final_zero`` init). Per adapted
layer and levels ``l = 0..L-1`` with ``s_l`` experts of rank ``r_l``::

    d_0 = 0,  d_{l+1} = d_l + s_l r_l                                  # hidden width recursion
    e_{l,i}(x) = c_l (B_{l,i} (A_{l,i} x + a_{l,i}) + b_{l,i})         # A (r_l, in), B (d_{l+1}, r_l)
    routing, top-down from level L-1:  x_bar = D x;  at level l each selected parent path p picks
        f_l children by softmax(MLP_l([x_bar, keys of p's ancestors]) K_l^T), renormalised
    forward, bottom-up:
        x_0[p]  = sum_{j in children(p)} g_j sigma(e_{0,j}(x))
        x_l[p]  = sum_{j in children(p)} g_j sigma(e_{l,j}(x) + W_l x_{l-1}[j] + w_l)
    y = W0 x + W_final x_{L-1} + b_final                                # W_final = 0 at init

so a token activates a sub-tree of ``prod_l f_l`` paths built from few low-rank matrices. Each
level's gate reports the switch balance loss ``lambda * s_l * sum_e f_e P_e`` (summed over levels
and layers) in training forwards, and its expert load (``statistics``). Not mergeable: the
routing and sigma depend on the input.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.adapters.common.layers import UnmergeableLayer
from rankwise.adapters.common.routing import RouterStats, switch_balance_loss
from rankwise.core.token_mask import valid_tokens

_ACTS = {"tanh": torch.tanh, "relu": F.relu, "identity": lambda t: t}


def _kaiming(t: torch.Tensor) -> None:
    """``nn.Linear``'s default init on every ``(out, in)`` slice of a stacked tensor."""
    for piece in t.reshape(-1, *t.shape[-2:]):
        nn.init.kaiming_uniform_(piece, a=math.sqrt(5))


class SmoreLevel(nn.Module):
    """The experts and gate of one level: ``A (s, r, in)``, ``a (s, r)``, ``B (s, d_next, r)``,
    ``b (s, d_next)``, the inter-level ``W (d_next, d_prev)``, ``w`` (levels >= 1), and a gate
    ``MLP(gate_in -> g -> g)`` with keys ``K (s, g)``."""

    def __init__(self, n_in: int, s: int, r: int, d_prev: int, d_next: int, gate_in: int, g: int,
                 gate_act: str, device=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": torch.float32}
        self.A = nn.Parameter(torch.empty(s, r, n_in, **kw))
        self.a = nn.Parameter(torch.zeros(s, r, **kw))
        self.B = nn.Parameter(torch.empty(s, d_next, r, **kw))
        self.b = nn.Parameter(torch.zeros(s, d_next, **kw))
        self.W = nn.Parameter(torch.empty(d_next, d_prev, **kw)) if d_prev else None
        self.w = nn.Parameter(torch.zeros(d_next, **kw)) if d_prev else None
        act = {"relu": nn.ReLU(), "tanh": nn.Tanh(), "identity": nn.Identity()}[gate_act]
        self.gate = nn.Sequential(nn.Linear(gate_in, g, **kw), act, nn.Linear(g, g, **kw))
        self.keys = nn.Parameter(torch.empty(s, g, **kw))
        for t in (self.A, self.B) + ((self.W,) if self.W is not None else ()):
            _kaiming(t)
        nn.init.uniform_(self.keys)  # the authors' init for MLP gates
        self.stats = RouterStats(s)


class SmoreTree(nn.Module):
    """One named S'MoRE adapter of a layer (see the module docstring for the equations).

    Args:
        n_in: Input features of the adapted layer.
        n_out: Output features.
        ranks: ``r_l`` per level.
        experts: ``s_l`` per level.
        fanout: ``f_l`` per level.
        gate_dims: Gate width per level.
        down_dim: Width of ``x_bar``.
        scales: ``c_l`` per level.
        expert_act: sigma's name.
        gate_act: Gate MLP activation's name.
        balance_weight: Switch balance-loss coefficient.
        device: Where the (float32) weights live.
    """

    def __init__(self, n_in: int, n_out: int, ranks: list[int], experts: list[int], fanout: list[int],
                 gate_dims: list[int], down_dim: int, scales: list[float], expert_act: str,
                 gate_act: str, balance_weight: float, device=None) -> None:
        super().__init__()
        levels = len(ranks)
        d = [0]
        for s, r in zip(experts, ranks):
            d.append(d[-1] + s * r)                      # d_{l+1} = d_l + s_l r_l
        self.d, self.fanout, self.scales = d, list(fanout), list(scales)
        self.act, self.balance_weight = _ACTS[expert_act], float(balance_weight)
        self.down = nn.Linear(n_in, down_dim, device=device, dtype=torch.float32)
        # level l's gate reads x_bar and the keys of its ancestors at levels l+1..L-1
        gate_in = [down_dim + sum(gate_dims[l + 1:]) for l in range(levels)]
        self.levels = nn.ModuleList(
            SmoreLevel(n_in, experts[l], ranks[l], d[l], d[l + 1], gate_in[l], gate_dims[l],
                       gate_act, device) for l in range(levels))
        self.W_final = nn.Parameter(torch.zeros(n_out, d[-1], device=device))
        self.b_final = nn.Parameter(torch.zeros(n_out, device=device))
        self.last_aux: dict[str, torch.Tensor] = {}
        self.token_mask: torch.Tensor | None = None   # the model's attention mask (hook-set)

    def route(self, x_bar: torch.Tensor, valid: torch.Tensor | None = None
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Top-down routing: per level, ``(indices, weights)`` of shape ``(N, P_l, f_l)`` with
        ``P_l = prod_{k > l} f_k`` parent paths (records the balance loss and the load over the
        tokens where ``valid (N,)`` is set; ``None``: all)."""
        gate_in = x_bar[:, None, :]                                        # (N, 1, d_down)
        picks: list = [None] * len(self.levels)
        balance = x_bar.new_zeros(())
        for l in reversed(range(len(self.levels))):
            lev, f = self.levels[l], self.fanout[l]
            probs = torch.softmax(lev.gate(gate_in) @ lev.keys.T, dim=-1)  # (N, P, s)
            top = probs.topk(f, dim=-1)
            weights = top.values / top.values.sum(-1, keepdim=True) if f > 1 else top.values
            chosen = torch.zeros_like(probs).scatter(-1, top.indices, 1.0)
            rows = None if valid is None else valid[:, None].expand(-1, probs.shape[1])  # (N, P)
            if self.training and self.balance_weight > 0:
                balance = balance + switch_balance_loss(probs, chosen, self.balance_weight, rows)
            lev.stats.update(torch.zeros_like(probs).scatter(-1, top.indices, weights), self.training, rows)
            picks[l] = (top.indices, weights)
            if l > 0:                                                      # children see parent keys
                keys = lev.keys[top.indices]                               # (N, P, f, g)
                wide = gate_in[:, :, None, :].expand(-1, -1, f, -1)
                gate_in = torch.cat([wide, keys], dim=-1).flatten(1, 2)    # (N, P f, dim + g)
        self.last_aux = {"balance_loss": balance} if self.training and self.balance_weight > 0 else {}
        return picks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The residual tree's output ``W_final x_{L-1} + b_final`` for tokens ``x (N, in)``."""
        picks = self.route(self.down(x), valid_tokens(self.token_mask, x.shape[:-1]))
        n, x_prev = x.shape[0], None
        for l, lev in enumerate(self.levels):
            idx, weights = picks[l]                                        # (N, P, f)
            _, p, f = idx.shape
            h = torch.einsum("ni,sri->nsr", x, lev.A) + lev.a              # (N, s, r)
            e = (torch.einsum("nsr,sdr->nsd", h, lev.B) + lev.b) * self.scales[l]  # (N, s, d_{l+1})
            width = e.shape[-1]
            picked = e.gather(1, idx.reshape(n, p * f, 1).expand(-1, -1, width)).reshape(n, p, f, width)
            if x_prev is not None:                                         # child subtrees' outputs
                picked = picked + x_prev.reshape(n, p, f, -1) @ lev.W.T + lev.w
            x_prev = (weights[..., None] * self.act(picked)).sum(2)        # (N, P, d_{l+1})
        return x_prev[:, 0] @ self.W_final.T + self.b_final                # (N, out)


class SmoreLayer(UnmergeableLayer):
    """A linear-like layer with named S'MoRE adapters (``AdapterModule``, not mergeable).

    Args:
        base_layer: ``nn.Linear``, ``Conv1D`` or a quantized linear; never modified.
    """

    adapters_attr = "trees"
    adapter_kind = "S'MoRE"
    unmergeable_reason = ("routed, non-linear residual experts; keep it as an adapter: export with "
                          "--format rankwise")

    def add(self, name: str, settings: dict[str, Any]) -> SmoreTree:
        """Add adapter ``name`` built from ``settings`` (the :meth:`describe` keys) and activate it."""
        s = dict(settings)
        alpha = s.get("alpha")
        scales = [1.0] * len(s["ranks"]) if alpha is None else [a / r for a, r in zip(alpha, s["ranks"])]
        device = next(self.base_layer.parameters()).device
        tree = SmoreTree(self.in_features, self.out_features, s["ranks"], s["experts"],
                         s["fanout"], s["gate_dims"], s["down_dim"], scales,
                         s["expert_act"], s["gate_act"], s["balance_weight"], device)
        return self.hold(name, tree, s)

    # ----- AdapterModule protocol -----------------------------------------------------------
    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """Every parameter of tree ``name`` by its path in the tree (``levels.0.A``, ``W_final``...)."""
        return dict(self.trees[name].named_parameters())

    def describe(self, name: str) -> dict[str, Any]:
        """Protocol capability: the level settings that rebuild tree ``name`` and its widths ``d``."""
        return {**self.settings[name], "d": list(self.trees[name].d)}

    def statistics(self) -> dict[str, Any]:
        """Protocol capability: expert load per level, ``{"<name>/level<l>": ...}``."""
        return {f"{n}/level{l}": lev.stats.as_dict() for n, t in self.trees.items()
                for l, lev in enumerate(t.levels)}

    def reset_statistics(self, modes: tuple[str, ...] = RouterStats.MODES) -> None:
        """Protocol capability: forget the load sums of ``modes``."""
        for t in self.trees.values():
            for lev in t.levels:
                lev.stats.reset(modes)

    # ----- compute ------------------------------------------------------------------------
    # forward: UnmergeableLayer's, W0 x plus every active tree's output; its last_aux holds the
    # balance loss of a training forward

    def extra_repr(self) -> str:
        return ", ".join(f"{n}: experts={s['experts']}, ranks={s['ranks']}, fanout={s['fanout']}"
                         for n, s in self.settings.items())
