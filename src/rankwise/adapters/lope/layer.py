"""LoPE: asymmetric LoRA experts with a poisoning expert (an ``AdapterModule``).

Wang et al., "Noise-Robustness Through Noise: Asymmetric LoRA Adaption with Poisoning Expert"
(LoPE, NeurIPS 2025, arXiv 2505.23868). The code was not found and only the abstract and
summaries could be read; this is the reading we chose, for one adapted layer with
normal experts ``i = 0..E-1`` and the poisoning expert ``p``::

    g(x) = softmax(R x)                                   # router over E + 1 experts, (..., E+1)
    training:   y = W x + s [ sum_i g_i(x) B_i A x  +  g_p(x) B_p A x ]
    inference:  y = W x + s   sum_i g_i(x) / (sum_j g_j(x)) B_i A x   # poisoning expert masked

* "asymmetric LoRA configuration": one shared ``A`` (Kaiming) and several ``B`` experts (zero
  at init, so the layer starts at the base output), HydraLoRA's layout, with a dense softmax
  router (``nn.Linear``'s default init).
* "a two-stage paradigm ... noise injection on the poisoning expert ... only with generated
  noisy data" (:class:`NoiseInjection`): in stage 1 (the first ``poison_steps`` training
  batches) every batch is replaced by *generated* noisy data - discrete noise, as the paper's
  limitations section names it: each real token replaced by a random vocabulary token, each
  class label by a random class, with probability ``noise_rate`` - and only the poisoning
  expert learns (the normal ``B_i`` are detached: ``A``, ``B_p`` and the router train). In
  stage 2 the task data is used as given, ``B_p`` is frozen (detached) and stays in the forward,
  so the router can send what resembles noise to it, while the normal experts learn.
* "we selectively mask the dedicated poisoning expert" at inference: its term is dropped and
  the normal experts' weights are renormalised over the normal experts (``renormalize``), so
  inference is the normal experts' mixture at the scale training gave it (without
  renormalisation about ``1/(E+1)`` of the routed output would vanish).

Not recoverable from what we could read, hence our choices: the noise generator (token and
label replacement at one rate), the stage lengths, which parameters train in each stage, and
the renormalisation. ``noise_std`` (Gaussian noise on the poisoning expert's input in training
forwards) is our earlier stand-in for noise injection, kept as an option (default off).

Masking follows the module's mode: ``model.eval()`` masks, ``model.train()`` uses the expert.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.adapters.common.factors import check_rank, lora_scale
from rankwise.adapters.common.layers import UnmergeableLayer
from rankwise.adapters.common.routing import RouterStats
from rankwise.core.token_mask import valid_tokens


class PoisonedExperts(nn.Module):
    """One named LoPE adapter: shared ``A``, normal ``B (E, out, r)``, the poisoning
    ``B_poison (out, r)``, router.

    The two ``B`` are separate parameters so that each stage leaves the other one out of the
    graph: its gradient stays ``None`` and the optimizer skips it (no momentum drift, no weight
    decay), which freezes it exactly.

    Args:
        n_in: Input features.
        n_out: Output features.
        r: Rank of A.
        num_experts: Normal experts E.
        scaling: s.
        noise_std: Poisoning-expert input noise, in units of each token's RMS.
        dropout: Dropout on the adapter input.
        device: Where the (float32) weights live.
        renormalize: At inference, divide the normal experts' weights by their sum.

    Attributes:
        stage: ``"poison"`` (stage 1: the normal ``B`` are left out of the graph), ``"task"``
            (stage 2: ``B_poison`` is) or ``None`` (everything trains); set by
            :class:`NoiseInjection`.
    """

    def __init__(self, n_in: int, n_out: int, r: int, num_experts: int, scaling: float,
                 noise_std: float, dropout: float = 0.0, device=None, renormalize: bool = True) -> None:
        super().__init__()
        kw = {"device": device, "dtype": torch.float32}
        self.lora_A = nn.Parameter(torch.empty(r, n_in, **kw))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(num_experts, n_out, r, **kw))
        self.lora_B_poison = nn.Parameter(torch.zeros(n_out, r, **kw))
        self.router = nn.Linear(n_in, num_experts + 1, bias=False, **kw)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling, self.noise_std, self.num_experts = scaling, float(noise_std), num_experts
        self.renormalize, self.stage, self.batches_seen = bool(renormalize), None, 0
        self.stats = RouterStats(num_experts + 1)
        self.poison_gate = PoisonGate()
        self.token_mask: torch.Tensor | None = None   # the model's attention mask (hook-set)

    def poison_term(self, x: torch.Tensor, gate: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """``g_p(x) B_p A (x + noise)`` (before the scale; ``B_p`` out of the graph in stage 2)."""
        h = F.linear(self.dropout(x if noise is None else x + noise), self.lora_A)   # (..., r)
        b_p = self.lora_B_poison.detach() if self.stage == "task" else self.lora_B_poison
        return gate[..., -1:] * F.linear(h, b_p)                                   # (..., out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution for float32 tokens ``x (..., in)``: in training
        ``s [sum_i g_i B_i A x + g_p B_p A (x + eps)]``, at inference
        ``s sum_i g_i / (sum_j g_j) B_i A x`` (see the module docstring)."""
        gate = torch.softmax(self.router(x), dim=-1)                                # (..., E+1)
        h = F.linear(self.dropout(x), self.lora_A)                                  # (..., r)
        weights = gate[..., :-1]                                                    # (..., E)
        if not self.training and self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        # sum_i w_i B_i h = [B_0 .. B_E-1] (w_i h)_i: one product, no (..., E, out) temporary
        routed = (weights[..., None] * h[..., None, :]).flatten(-2)               # (..., E r)
        b = self.lora_B.detach() if self.training and self.stage == "poison" else self.lora_B
        normal = b.permute(1, 0, 2).reshape(b.shape[1], -1)                         # (out, E r)
        y = F.linear(routed, normal)                                                # (..., out)
        valid = valid_tokens(self.token_mask, x.shape[:-1])
        mode = ("noisy" if self.stage == "poison" else "task") if self.training else "eval"
        self.poison_gate.update(gate[..., -1], mode, valid)
        if self.training:
            noise = None
            if self.noise_std > 0:
                rms = x.detach().pow(2).mean(-1, keepdim=True).sqrt()
                noise = self.noise_std * rms * torch.randn_like(x)
            y = y + self.poison_term(x, gate, noise)
            self.stats.update(gate, True, valid)
        else:
            self.stats.update(torch.cat([gate[..., :-1], torch.zeros_like(gate[..., -1:])], -1), False,
                              valid)
        return y * self.scaling


class LopeLayer(UnmergeableLayer):
    """A linear-like layer with named LoPE adapters (``AdapterModule``, not mergeable).

    Args:
        base_layer: ``nn.Linear``, ``Conv1D`` or a quantized linear; never modified.
    """

    adapters_attr = "experts"
    adapter_kind = "LoPE"
    unmergeable_reason = ("its router weighs the experts per token, and its poisoning expert is "
                          "masked only at inference; keep it as an adapter: export with --format rankwise")

    def add(self, name: str, r: int, num_experts: int, alpha: float, noise_std: float,
            dropout: float = 0.0, use_rslora: bool = False, renormalize: bool = True) -> PoisonedExperts:
        """Add LoPE adapter ``name`` and make it active.

        Raises:
            RankwiseError: If ``r`` is outside [1, min(in, out)].
        """
        check_rank(r, self.in_features, self.out_features)
        device = next(self.base_layer.parameters()).device
        experts = PoisonedExperts(self.in_features, self.out_features, r, num_experts,
                                  lora_scale(r, alpha, use_rslora), noise_std, dropout, device,
                                  renormalize)
        return self.hold(name, experts, {"r": r, "num_experts": num_experts, "alpha": alpha,
                                         "use_rslora": use_rslora})

    # ----- AdapterModule protocol -----------------------------------------------------------
    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """``{"lora_A", "lora_B" (E, out, r), "lora_B_poison" (out, r), "router.weight"}``."""
        e = self.experts[name]
        return {"lora_A": e.lora_A, "lora_B": e.lora_B, "lora_B_poison": e.lora_B_poison,
                "router.weight": e.router.weight}

    def describe(self, name: str) -> dict[str, Any]:
        """Protocol capability: ``{"r", "num_experts", "alpha", "use_rslora", "batches_seen"}``
        (``batches_seen``: training batches of the two-stage schedule so far, so a resumed run
        continues in the right stage)."""
        return {**self.settings[name], "batches_seen": self.experts[name].batches_seen}

    def statistics(self) -> dict[str, Any]:
        """Protocol capability: router load per adapter (the last expert is the poisoning one;
        its evaluation load is 0 because it is masked), plus ``poison_gate``: the router's mean
        weight ``g_p`` on the poisoning expert on stage 1's noisy data, on stage 2's task data
        and on evaluation data (before masking), :class:`PoisonGate`."""
        return {n: {**e.stats.as_dict(), "poison_gate": e.poison_gate.as_dict()}
                for n, e in self.experts.items()}

    def reset_statistics(self, modes: tuple[str, ...] = RouterStats.MODES) -> None:
        """Protocol capability: forget the load sums of ``modes`` (``train`` also forgets the
        noisy- and task-data gate means)."""
        for e in self.experts.values():
            e.stats.reset(modes)
            e.poison_gate.reset(modes)

    # ----- compute ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``W x`` plus every active adapter (see the module docstring)."""
        out = self.base_layer(x)
        if self._active:
            xf = x if x.dtype == torch.float32 else x.float()
            for name in self._active:
                out = out + self.experts[name](xf).to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return ", ".join(f"{n}: r={s['r']}, experts={s['num_experts']}+poison"
                         for n, s in self.settings.items())


class PoisonGate:
    """Mean router weight of the poisoning expert, ``mean g_p(x)`` over real tokens, per kind
    of data: ``noisy`` (stage-1 training forwards on generated noisy data), ``task`` (stage-2
    training forwards on the task data) and ``eval`` (evaluation forwards, the weight the
    router gives before the expert is masked). A large ``task``/``eval`` value means the router
    sends clean inputs to the poisoning expert, so masking it removes task signal; the reading
    LoPE rests on wants ``noisy`` well above ``eval``.
    """

    KINDS = ("noisy", "task", "eval")

    def __init__(self) -> None:
        self._sums: dict[str, list[torch.Tensor]] = {}

    @torch.no_grad()
    def update(self, g_p: torch.Tensor, kind: str, valid: torch.Tensor | None = None) -> None:
        """Add one forward's ``g_p (...)`` (positions where ``valid`` is unset are padding)."""
        w = g_p.detach().float().reshape(-1)
        if valid is not None:
            w = w[valid.reshape(-1).to(w.device)]
        acc = self._sums.setdefault(kind, [torch.zeros((), device=w.device), torch.zeros((), device=w.device)])
        acc[0] += w.sum()
        acc[1] += w.numel()

    def reset(self, modes: tuple[str, ...]) -> None:
        """Forget ``eval`` when ``"eval"`` is in ``modes``, ``noisy`` and ``task`` for ``"train"``."""
        for kind in (("noisy", "task") if "train" in modes else ()) + (("eval",) if "eval" in modes else ()):
            self._sums.pop(kind, None)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{kind: {"mean": mean g_p, "tokens": count}}`` for the kinds seen."""
        return {k: {"mean": float(s / n.clamp_min(1)), "tokens": int(n)} for k, (s, n) in self._sums.items()}


class NoiseInjection(nn.Module):
    """LoPE's two-stage schedule and its generated noisy data, as an ``InputAdapter``.

    Every training batch passes through :meth:`transform_inputs` (the engine's tasks call it
    before each forward). The first ``poison_steps`` training batches are stage 1: the batch is
    replaced by generated noisy data (:func:`discrete_noise`) and every LoPE adapter of the
    model is put in stage ``"poison"``; the whole modules trained beside the adapter (a
    classifier head, hooked by :meth:`hold_heads`) run with detached weights, so in stage 1
    only the poisoning expert learns. Later batches are stage 2 (``"task"``), unchanged.
    Evaluation batches (``model.eval()``) are never touched. The count lives in this module
    (``batches``) and in every LoPE adapter (``batches_seen``, reported by ``describe``), so a
    checkpoint records it and :func:`rankwise.adapters.lope.rebuild_lope` restores it.

    Args:
        poison_steps: Training batches of stage 1 (with gradient accumulation, micro-batches).
        noise_rate: Probability that a real token, and a class label, is replaced.
        seed: Seeds the noise (with the batch count, so reruns draw the same noise).
    """

    def __init__(self, poison_steps: int, noise_rate: float, seed: int = 0) -> None:
        super().__init__()
        self.poison_steps, self.noise_rate, self.seed = int(poison_steps), float(noise_rate), int(seed)
        self.batches, self.stage, self._inside = 0, None, False

    def hold_heads(self, heads: list[nn.Module]) -> None:
        """Keep ``heads`` (modules trained beside the adapter) out of stage 1's learning: a
        forward hook recomputes their output with detached weights (their gradient stays
        ``None``, so the optimizer skips them), while the gradient still flows to their input."""
        for head in heads:
            head.register_forward_hook(self._detached_in_stage_one)

    def _detached_in_stage_one(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not (module.training and self.stage == "poison") or self._inside:
            return None
        self._inside = True
        try:
            weights = {n: p.detach() for n, p in module.named_parameters()}
            return torch.func.functional_call(module, weights, args)
        finally:
            self._inside = False

    def virtual_tokens(self) -> int:
        """``InputAdapter``: no positions are added."""
        return 0

    def transform_inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stage 1: generated noisy data and ``stage = "poison"``; stage 2: the batch as given."""
        if not model.training or "input_ids" not in batch:
            return batch
        self.batches += 1
        stage = self.stage = "poison" if self.batches <= self.poison_steps else "task"
        for module in model.modules():
            if isinstance(module, PoisonedExperts):
                module.stage, module.batches_seen = stage, self.batches
        if stage != "poison":
            return batch
        vocab = model.get_input_embeddings().num_embeddings
        classes = int(getattr(getattr(model, "config", None), "num_labels", 0) or 0)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.batches)
        return discrete_noise(batch, self.noise_rate, vocab, classes, g)


def discrete_noise(batch: dict[str, torch.Tensor], rate: float, vocab: int, classes: int,
                   generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Generated noisy data: each real token (``attention_mask`` 1) becomes a uniform random
    vocabulary token with probability ``rate``; causal-LM labels follow their tokens (the noisy
    text is the target); each class label ``(B,)`` becomes a uniform random class with
    probability ``rate``.

    Args:
        batch: ``input_ids``, optional ``attention_mask`` and ``labels``.
        rate: Replacement probability.
        vocab: Vocabulary size.
        classes: Number of classes (0: no class labels are touched).
        generator: CPU generator of the draws.

    Returns:
        A new batch (the input tensors are not modified).
    """
    out = dict(batch)
    ids = batch["input_ids"]
    real = batch.get("attention_mask", torch.ones_like(ids)).bool().cpu()
    hit = (torch.rand(ids.shape, generator=generator) < rate) & real                # (B, T)
    new = torch.randint(0, vocab, ids.shape, generator=generator)
    hit, new = hit.to(ids.device), new.to(ids.device)
    out["input_ids"] = torch.where(hit, new, ids)
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and labels.shape == ids.shape:             # causal LM
        out["labels"] = torch.where(hit & labels.eq(ids), new, labels)
    elif isinstance(labels, torch.Tensor) and labels.dim() == 1 and classes > 1:    # classes
        flip = (torch.rand(labels.shape, generator=generator) < rate).to(labels.device)
        rand = torch.randint(0, classes, labels.shape, generator=generator).to(labels.device)
        out["labels"] = torch.where(flip, rand, labels)
    return out
