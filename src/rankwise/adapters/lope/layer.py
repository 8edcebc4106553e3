"""LoPE: asymmetric LoRA experts with a poisoning expert (an ``AdapterModule``).

"Noise-Robust Adaptation via Asymmetric LoRA Poisoning Experts" (LoPE, NeurIPS 2025, arXiv
2505.23868). The code was not found (notes §4.3); this is the reading we chose from the paper's
words, for one adapted layer with normal experts ``i = 0..E-1`` and the poisoning expert ``p``::

    g(x) = softmax(R x)                                   # router over E + 1 experts, (..., E+1)
    training:   y = W x + s [ sum_i g_i(x) B_i A x  +  g_p(x) B_p A (x + eps) ]
    inference:  y = W x + s   sum_i g_i(x) B_i A x        # poisoning expert masked
    eps = noise_std * rms(x) * N(0, I)                    # drawn per token, training only

* "asymmetric LoRA configuration": one shared ``A`` (Kaiming) and several ``B`` experts (zero
  at init, so the layer starts at the base output), HydraLoRA's layout, with a dense softmax
  router (``nn.Linear``'s default init).
* "noise injection on the poisoning expert": the paper generates noisy data for it; here the
  noise is generated in feature space, on the poisoning expert's input only, in every training
  forward. The paper's two stages (noise injection, then fine-tuning) run jointly, since the
  stage schedule and noise recipe were not published.
* "we selectively mask the dedicated poisoning expert" at inference: its term is dropped and the
  normal experts' router weights are *not* renormalised, so the inference output differs from a
  noise-free training forward exactly by ``s g_p(x) B_p A x`` (tested).

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


class PoisonedExperts(nn.Module):
    """One named LoPE adapter: shared ``A``, ``B (E+1, out, r)`` (last = poisoning), router.

    Args:
        n_in: Input features.
        n_out: Output features.
        r: Rank of A.
        num_experts: Normal experts E.
        scaling: s.
        noise_std: Poisoning-expert input noise, in units of each token's RMS.
        dropout: Dropout on the adapter input.
        device: Where the (float32) weights live.
    """

    def __init__(self, n_in: int, n_out: int, r: int, num_experts: int, scaling: float,
                 noise_std: float, dropout: float = 0.0, device=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": torch.float32}
        self.lora_A = nn.Parameter(torch.empty(r, n_in, **kw))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(num_experts + 1, n_out, r, **kw))
        self.router = nn.Linear(n_in, num_experts + 1, bias=False, **kw)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling, self.noise_std, self.num_experts = scaling, float(noise_std), num_experts
        self.stats = RouterStats(num_experts + 1)

    def poison_term(self, x: torch.Tensor, gate: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """``g_p(x) B_p A (x + noise)`` (before the scale)."""
        h = F.linear(self.dropout(x if noise is None else x + noise), self.lora_A)   # (..., r)
        return gate[..., -1:] * F.linear(h, self.lora_B[-1])                       # (..., out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution ``s [sum_i g_i B_i A x (+ g_p B_p A (x + eps) in training)]``
        for float32 tokens ``x (..., in)``."""
        gate = torch.softmax(self.router(x), dim=-1)                                # (..., E+1)
        h = F.linear(self.dropout(x), self.lora_A)                                  # (..., r)
        # sum_i g_i B_i h = [B_0 .. B_E-1] (g_i h)_i: one product, no (..., E, out) temporary
        routed = (gate[..., :-1, None] * h[..., None, :]).flatten(-2)             # (..., E r)
        normal = self.lora_B[:-1].permute(1, 0, 2).reshape(self.lora_B.shape[1], -1)  # (out, E r)
        y = F.linear(routed, normal)                                                # (..., out)
        if self.training:
            noise = None
            if self.noise_std > 0:
                rms = x.detach().pow(2).mean(-1, keepdim=True).sqrt()
                noise = self.noise_std * rms * torch.randn_like(x)
            y = y + self.poison_term(x, gate, noise)
            self.stats.update(gate, True)
        else:
            self.stats.update(torch.cat([gate[..., :-1], torch.zeros_like(gate[..., -1:])], -1), False)
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
            dropout: float = 0.0, use_rslora: bool = False) -> PoisonedExperts:
        """Add LoPE adapter ``name`` and make it active.

        Raises:
            RankwiseError: If ``r`` is outside [1, min(in, out)].
        """
        check_rank(r, self.in_features, self.out_features)
        device = next(self.base_layer.parameters()).device
        experts = PoisonedExperts(self.in_features, self.out_features, r, num_experts,
                                  lora_scale(r, alpha, use_rslora), noise_std, dropout, device)
        return self.hold(name, experts, {"r": r, "num_experts": num_experts, "alpha": alpha,
                                         "use_rslora": use_rslora})

    # ----- AdapterModule protocol -----------------------------------------------------------
    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """``{"lora_A", "lora_B" (E+1, out, r; last = poisoning), "router.weight"}``."""
        e = self.experts[name]
        return {"lora_A": e.lora_A, "lora_B": e.lora_B, "router.weight": e.router.weight}

    def describe(self, name: str) -> dict[str, Any]:
        """Protocol capability: ``{"r", "num_experts", "alpha", "use_rslora"}``."""
        return dict(self.settings[name])

    def statistics(self) -> dict[str, Any]:
        """Protocol capability: router load per adapter (the last expert is the poisoning one;
        its evaluation load is 0 because it is masked)."""
        return {n: e.stats.as_dict() for n, e in self.experts.items()}

    def reset_statistics(self, modes: tuple[str, ...] = RouterStats.MODES) -> None:
        """Protocol capability: forget the load sums of ``modes``."""
        for e in self.experts.values():
            e.stats.reset(modes)

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
