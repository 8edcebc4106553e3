"""Prefix generators held by :class:`~rankwise.adapters.prompt.layer.PromptLayer`.

Each is called as ``generator(embeds (B, T, h), mask (B, T), labels) -> prefix (B, v, h)`` and
has ``num_tokens`` (v) and ``describe()``:

* :class:`SoftPrompt` - prompt tuning (Lester et al. 2021, Sec. 2: ``[P_e; X_e]``).
* :class:`PromptMixture` - PT-MoE (Li et al., arXiv 2505.09519): ``P_i = A_i B``, B shared,
  routed per input.
* :class:`CapsulePrompt` - CaPT (arXiv 2510.16670): one instance-aware capsule per layer at
  position 0.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rankwise.adapters.common.routing import RouterStats
from rankwise.errors import RankwiseError

IGNORE_INDEX = -100


def masked_mean(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``h (B, T, d)`` over positions where ``mask (B, T)`` is set (0 if none), float32."""
    m = mask.to(torch.float32).unsqueeze(-1)                               # (B, T, 1)
    return (h.float() * m).sum(1) / m.sum(1).clamp_min(1.0)                # (B, d)


def instance_mask(mask: torch.Tensor, labels: Any) -> torch.Tensor:
    """The positions a per-input router or capsule may pool: the real tokens (``mask``) that
    carry no loss. For a causal LM (``labels (B, T)``) that is the prompt part (labels
    ``-100``): pooling a target token would show it to every earlier position, and at
    generation only the prompt exists. Class labels ``(B,)`` or none: every real token.

    Args:
        mask: Attention mask ``(B, T)``.
        labels: The batch's labels (a tensor or ``None``).

    Returns:
        A bool ``(B, T)`` mask.
    """
    instance = mask.bool()
    if isinstance(labels, torch.Tensor) and labels.dim() == 2 and labels.shape == mask.shape:
        instance = instance & labels.eq(IGNORE_INDEX)
    return instance


def vocab_sample(table: nn.Embedding, n: int) -> torch.Tensor:
    """Embeddings of ``n`` token ids drawn uniformly from the vocabulary (float32, detached)."""
    ids = torch.randint(0, table.num_embeddings, (n,), device=table.weight.device)
    return table.weight[ids].detach().float().clone()


class SoftPrompt(nn.Module):
    """Prompt tuning: ``n`` free vectors ``prompt_embeddings (n, h)`` in front of every input.

    Args:
        table: The model's input embeddings (for the initialisation).
        n: Prompt length.
        init: ``vocab`` (n random vocabulary embeddings) or ``random`` (N(0, std(table)^2)).
    """

    def __init__(self, table: nn.Embedding, n: int, init: str) -> None:
        super().__init__()
        if init == "vocab":
            start = vocab_sample(table, n)
        else:
            std = float(table.weight.detach().float().std())
            start = torch.randn(n, table.embedding_dim, device=table.weight.device) * std
        self.prompt_embeddings = nn.Parameter(start)
        self.num_tokens = n

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor, labels: Any) -> torch.Tensor:
        """The same ``(B, n, h)`` prefix for every example."""
        return self.prompt_embeddings.unsqueeze(0).expand(embeds.shape[0], -1, -1)

    def describe(self) -> dict[str, Any]:
        """``{"num_virtual_tokens", "token_dim"}``."""
        return {"num_virtual_tokens": self.num_tokens, "token_dim": self.prompt_embeddings.shape[1]}


class PromptMixture(nn.Module):
    """PT-MoE's routed, decomposed prompts.

    Our reading of the paper (code not released; paper text, abstract, a third-party summary)::

        P_i = A_i B,  A_i (n, R) per expert,  B (R, h) shared
        x_bar = mean of the input embeddings over the instance;  l = W x_bar + b
        training: l' = l * (1 + eps), eps ~ N(0, noise_std^2);  eval: l' = l
        w = softmax(l') restricted to the top_k experts (not renormalised, so the router learns)
        prefix = sum_i w_i P_i

    Initialisation (the paper's SVD of task-text embeddings, with vocabulary embeddings as the
    text): ``E`` = embeddings of ``N n`` random tokens, ``E = U S V^T``; ``B = S_R^{1/2} V_R^T``
    and the rows of ``U_R S_R^{1/2}`` split into the ``A_i``, so ``P_i`` starts at the rank-R
    approximation of its own block of E.

    The instance pooled into ``x_bar`` is :func:`instance_mask`'s: for a causal LM only the
    tokens that carry no loss (the prompt), as CaPT pools, so a target token never reaches the
    router and through it the prefix every earlier position attends to (tested: 0 difference),
    and training routes on what generation will see. The paper's sigma was not in what we could
    read; ``noise_std`` defaults to 0.1 (see :class:`PtMoeConfig`).

    Args:
        table: The model's input embeddings.
        n: Prompt length.
        num_experts: N.
        rank: R.
        top_k: Experts mixed per input.
        noise_std: Router noise sigma (training only).

    Raises:
        RankwiseError: If ``rank`` exceeds ``min(N n, hidden)``.
    """

    def __init__(self, table: nn.Embedding, n: int, num_experts: int, rank: int, top_k: int,
                 noise_std: float) -> None:
        super().__init__()
        h = table.embedding_dim
        if rank > min(num_experts * n, h):
            raise RankwiseError(f"pt-moe rank {rank} exceeds min(num_experts * num_virtual_tokens, "
                                f"hidden) = {min(num_experts * n, h)}; lower method.rank")
        u, s, vt = torch.linalg.svd(vocab_sample(table, num_experts * n), full_matrices=False)
        root = s[:rank].sqrt()
        self.A = nn.Parameter((u[:, :rank] * root).reshape(num_experts, n, rank).contiguous())
        self.B = nn.Parameter((root[:, None] * vt[:rank]).contiguous())
        self.router = nn.Linear(h, num_experts, device=table.weight.device)
        self.num_tokens, self.top_k, self.noise_std = n, top_k, float(noise_std)
        self.stats = RouterStats(num_experts)

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor, labels: Any) -> torch.Tensor:
        """The routed prefix ``sum_i w_i A_i B`` per example, ``(B, n, h)``."""
        logits = self.router(masked_mean(embeds, instance_mask(mask, labels)))  # (B, N)
        if self.training and self.noise_std > 0:
            logits = logits * (1 + self.noise_std * torch.randn_like(logits))
        probs = torch.softmax(logits, dim=-1)
        top = probs.topk(self.top_k, dim=-1)
        w = torch.zeros_like(probs).scatter(-1, top.indices, top.values)      # (B, N)
        self.stats.update(w, self.training)
        prompts = torch.einsum("inr,rh->inh", self.A, self.B)                  # (N, n, h)
        return torch.einsum("bi,inh->bnh", w, prompts)                         # (B, n, h)

    def describe(self) -> dict[str, Any]:
        """``{"num_virtual_tokens", "num_experts", "rank", "token_dim"}``."""
        return {"num_virtual_tokens": self.num_tokens, "num_experts": self.A.shape[0],
                "rank": self.A.shape[2], "token_dim": self.B.shape[1]}


def find_blocks(model: nn.Module, blocks: str) -> tuple[str, nn.ModuleList]:
    """The transformer blocks: ``blocks`` (a path) or, for ``auto``, the longest ``ModuleList``
    of modules of one class.

    Raises:
        RankwiseError: If there is no such list (or the path is not a ``ModuleList``).
    """
    if blocks != "auto":
        found = dict(model.named_modules()).get(blocks)
        if not isinstance(found, nn.ModuleList) or not len(found):
            raise RankwiseError(f"method.blocks: {blocks!r} is not a ModuleList of transformer blocks "
                                "in this model; use auto or a path such as model.layers")
        return blocks, found
    lists = [(p, m) for p, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1]
    if not lists:
        raise RankwiseError("capt needs a model with a list of transformer blocks (none found); "
                            "set method.blocks to its path")
    return max(lists, key=lambda pm: len(pm[1]))


class _CapsuleHook:
    """Forward pre-hook of block ``i``: position 0 becomes ``p_i + mean(hidden over the instance)``."""

    def __init__(self, owner: "CapsulePrompt", i: int) -> None:
        self.owner, self.i = owner, i

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        pool = self.owner.pool_mask
        on_args = bool(args)
        hidden = args[0] if on_args else kwargs.get("hidden_states")
        if pool is None or not self.owner.active or hidden is None or hidden.shape[:2] != pool.shape:
            return None                                 # a cached decoding step, or not our batch
        capsule = self.owner.capsules[self.i] + masked_mean(hidden, pool)       # (B, h)
        hidden = torch.cat([capsule.unsqueeze(1).to(hidden.dtype), hidden[:, 1:]], dim=1)
        if on_args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}


class CapsulePrompt(nn.Module):
    """CaPT: one capsule at position 0, renewed at every transformer block.

    Our reading of the paper (code not found; paper text, abstract, a third-party summary): a single virtual token at position 0;
    before block ``i`` runs, its hidden state is replaced by the capsule
    ``S_i = p_i + mean(h_{i-1} over the instance's tokens)``, where ``h_{i-1}`` is the previous
    block's output (the embedding output for block 0) and ``p_i`` is learned (zero at
    initialisation: the capsule starts as the training-free instance token of the paper's
    analysis). The instance is the real tokens that carry no loss: all of them for
    classification; for a causal LM only the prompt part (labels ``-100``), because pooling target
    tokens into position 0 would show them to every earlier position.

    Args:
        model: The model (its blocks get forward pre-hooks).
        blocks: ``auto`` or the path of the block list.
        hidden: Hidden size.
    """

    def __init__(self, model: nn.Module, blocks: str, hidden: int) -> None:
        super().__init__()
        self.blocks_path, block_list = find_blocks(model, blocks)
        device = next(block_list.parameters()).device
        self.capsules = nn.Parameter(torch.zeros(len(block_list), hidden, device=device))
        self.num_tokens, self.active = 1, True
        self.pool_mask: torch.Tensor | None = None
        self._handles = [b.register_forward_pre_hook(_CapsuleHook(self, i), with_kwargs=True)
                         for i, b in enumerate(block_list)]

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor, labels: Any) -> torch.Tensor:
        """Record the instance positions for the block hooks; return a ``(B, 1, h)`` placeholder."""
        instance = instance_mask(mask, labels)
        self.pool_mask = torch.cat([instance.new_zeros(mask.shape[0], 1), instance], dim=1)
        return embeds.new_zeros(embeds.shape[0], 1, embeds.shape[2])          # overwritten by the hooks

    def detach(self) -> None:
        """Remove the block hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def describe(self) -> dict[str, Any]:
        """``{"blocks", "layers", "token_dim"}``."""
        return {"blocks": self.blocks_path, "layers": self.capsules.shape[0],
                "token_dim": self.capsules.shape[1]}
