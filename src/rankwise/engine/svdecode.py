"""Steering-vector decoding (``rankwise generate --steer svdecode --steer-from RUN``).

Hu, Han et al., "Distribution-Aligned Decoding for Efficient LLM Task Adaptation" (SVDecode,
arXiv 2509.15888, NeurIPS 2025): a short warm-start PEFT fine-tune gives a warm distribution
``P_warm``; the base model (the same model with its adapters off) gives ``P_pre``; at every
decoding step the logits move along the logit-space gradient of KL(P_warm || P_pre), restricted by
a confidence-aware mask, with a step size in closed form. No parameter is trained and nothing is
differentiated at decode time: the direction is the closed-form gradient, evaluated from two
forward passes (warm and pre) that share nothing but the weights.

The exact formula implemented is written in :class:`SVDecode`; the paper's text available to us
(abstract, project page, third-party summaries) does not give the mask rule or μ's formula, so
both are our own closed forms, marked as such there and in ``docs/svdecode.md``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from rankwise.core.ops import disable_adapters
from rankwise.core.protocol import attach_input_hook, input_adapters
from rankwise.errors import RankwiseError


@dataclass
class SVDecodeConfig:
    """Settings of :class:`SVDecode` (the CLI's ``--steer-*`` flags override them).

    Attributes:
        mask_ratio: τ of the confidence mask: a token is steered only where its warm probability
            is at least ``τ · max_j p_warm_j`` (0 = steer every token, 1 = only the warm top-1).
        strength: λ, a multiplier on the closed-form step μ* (0 = plain decoding, 1 = the
            Gauss-Newton step).
        max_mu: Upper clip of μ* (the step blows up when the masked direction lies where the base
            distribution is nearly flat, i.e. the denominator is tiny).
        eps: Added to the Gauss-Newton denominator.
    """

    mask_ratio: float = 0.1
    strength: float = 1.0
    max_mu: float = 4.0
    eps: float = 1e-8

    def check(self) -> None:
        """Raises RankwiseError on a value outside its range (one line naming the flag)."""
        if not 0.0 <= self.mask_ratio <= 1.0:
            raise RankwiseError(f"--steer-mask {self.mask_ratio} is outside [0, 1]; pass the "
                                "fraction of the warm top-1 probability a token needs to be steered")
        if self.strength < 0 or self.max_mu < 0 or self.eps <= 0:
            raise RankwiseError(f"--steer-strength {self.strength} and --steer-max-mu {self.max_mu} "
                                "must be >= 0 (0 = plain decoding)")


class SVDecode:
    """SVDecode's logit update (arXiv 2509.15888; the paper's steering vector, mask and μ).

    For one decoding step with decode logits ``z`` (the model being decoded; the warm-start run
    itself in the usual case, so ``z = z_w``), warm logits ``z_w`` and base logits ``z_0``
    (adapters off), with ``p_w = softmax(z_w)`` and ``p_0 = softmax(z_0)``:

    * steering vector (paper: the KL gradient projected to logit space)::

          δ = p_w − p_0 = −∂/∂z KL(p_w ‖ softmax(z)) at z = z_0

      (the logit-space gradient is exact here: no Jacobian approximation is needed, because the
      KL is taken with respect to the logits themselves).
    * confidence-aware mask (**our rule; the paper leaves its exact form open to us**)::

          m_i = 1[p_w,i ≥ τ · max_j p_w,j],     d = m ⊙ δ

      i.e. only tokens the warm model finds plausible are moved (the adaptive plausibility
      constraint of contrastive decoding), so low-probability noise in δ cannot promote a token.
    * step size (**our closed form; the paper says "globally optimal", Gauss-Newton, but its
      formula was not available**): the minimiser in μ of the second-order (Gauss-Newton) model
      of ``KL(p_w ‖ softmax(z_0 + μ d))`` around μ = 0, whose Hessian in z is the softmax
      Fisher ``F(p_0) = diag(p_0) − p_0 p_0ᵀ``::

          μ* = dᵀδ / (dᵀ F(p_0) d + ε) = Σ m δ² / (Σ p_0 d² − (Σ p_0 d)² + ε)

      then ``μ = λ · min(μ*, μ_max)`` (μ* ≥ 0 always).
    * steered logits::

          z' = z + μ d

    λ = 0 gives ``z' = z`` exactly (plain decoding). Everything is a closed form of the three
    logit vectors: :meth:`steer` runs under ``torch.no_grad`` and creates no parameter.
    """

    def __init__(self, config: SVDecodeConfig | None = None) -> None:
        self.config = config or SVDecodeConfig()
        self.config.check()

    def mask(self, p_warm: torch.Tensor) -> torch.Tensor:
        """``m`` (bool, same shape): tokens with ``p_w ≥ τ · max p_w`` along the last dim."""
        top = p_warm.max(dim=-1, keepdim=True).values
        return p_warm >= self.config.mask_ratio * top

    def step_size(self, d: torch.Tensor, delta: torch.Tensor, p_pre: torch.Tensor) -> torch.Tensor:
        """μ (one per row): ``λ · min(dᵀδ / (dᵀ F(p_0) d + ε), μ_max)``."""
        c = self.config
        num = (d * delta).sum(-1, keepdim=True)
        den = (p_pre * d * d).sum(-1, keepdim=True) - (p_pre * d).sum(-1, keepdim=True) ** 2
        mu = num / (den.clamp_min(0.0) + c.eps)
        return c.strength * mu.clamp(0.0, c.max_mu)

    @torch.no_grad()
    def steer(self, z: torch.Tensor, z_warm: torch.Tensor, z_pre: torch.Tensor) -> torch.Tensor:
        """The steered logits ``z + μ (m ⊙ (p_w − p_0))`` (computed in at least float32,
        returned in ``z``'s dtype; any leading batch dims)."""
        if self.config.strength == 0:
            return z
        dt = torch.promote_types(z.dtype, torch.float32)
        p_w = torch.softmax(z_warm.to(dt), -1)
        p_0 = torch.softmax(z_pre.to(dt), -1)
        delta = p_w - p_0
        d = torch.where(self.mask(p_w), delta, torch.zeros_like(delta))
        return (z.to(dt) + self.step_size(d, delta, p_0) * d).to(z.dtype)


class _Stream:
    """One model's incremental forward with its own KV cache (adapters on or off)."""

    def __init__(self, model: nn.Module, adapters_off: bool) -> None:
        from transformers import DynamicCache
        self.model, self.off = model, adapters_off
        self.cache = DynamicCache(config=model.config)
        self.seen = 0

    def logits(self, ids: list[int], device: str) -> torch.Tensor:
        new = torch.tensor([ids[self.seen:]], dtype=torch.long, device=device)
        mask = torch.ones(1, len(ids), dtype=torch.long, device=device)  # the real tokens only
        ctx = disable_adapters(self.model) if self.off else contextlib.nullcontext()
        with ctx:
            out = self.model(input_ids=new, attention_mask=mask, cache=self.cache, use_cache=True)
        self.seen = len(ids)
        return out.logits[0, -1]


def _pick(logits: torch.Tensor, temperature: float, top_p: float) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1))


@torch.no_grad()
def steered_generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_id: int,
                     steer: SVDecode, warm: nn.Module | None = None, temperature: float = 0.0,
                     top_p: float = 1.0, device: str = "cpu",
                     on_step: Callable[[torch.Tensor], Any] | None = None) -> list[int]:
    """Decode ``prompt_ids`` with SVDecode: ``z' = steer.steer(z, z_w, z_0)`` at every step.

    Args:
        model: The model decoded (adapters in place).
        prompt_ids: The formatted prompt.
        max_new_tokens: Upper bound on new tokens.
        eos_id: Decoding stops at this token (not returned).
        steer: The update.
        warm: The warm-start model (adapters on); ``None``: ``model`` itself. Its adapters off give
            the base distribution.
        temperature: 0 = greedy, else sampling at this temperature.
        top_p: Nucleus mass when sampling.
        device: Where the ids go.
        on_step: Receives the steered logits of every step (tests, scores).

    Returns:
        The new token ids.
    """
    warm_model = model if warm is None else warm
    for m in {id(model): model, id(warm_model): warm_model}.values():
        m.eval()
        if input_adapters(m):
            attach_input_hook(m)
    streams = [_Stream(model, False)]
    if steer.config.strength != 0:
        if warm is not None:
            streams.append(_Stream(warm, False))
        streams.append(_Stream(warm_model, True))
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        got = [s.logits(ids, device) for s in streams]
        z = got[0]
        z_warm = got[1] if len(got) == 3 else z
        z = steer.steer(z, z_warm, got[-1]) if len(got) > 1 else z
        if on_step is not None:
            on_step(z)
        tok = _pick(z, temperature, top_p)
        if tok == eos_id:
            break
        new.append(tok)
        ids.append(tok)
    return new


__all__ = ["SVDecode", "SVDecodeConfig", "steered_generate"]
