"""Steering-vector decoding (``rankwise generate --steer svdecode --steer-from RUN``), a logits
hook of the one decode loop (:class:`SteerHook`).

Hu, Han et al., "Distribution-Aligned Decoding for Efficient LLM Task Adaptation" (SVDecode,
arXiv 2509.15888, NeurIPS 2025): a short warm-start PEFT fine-tune gives a warm distribution
``P_warm``; the base model (the same model with its adapters off) gives ``P_pre``; at every
decoding step the logits move along the logit-space gradient of KL(P_warm || P_pre), restricted by
a confidence-aware mask, with a step size in closed form. No parameter is trained and nothing is
differentiated at decode time: the direction is the closed-form gradient, evaluated from two
forward passes (warm and pre) that share nothing but the weights.

The exact formula implemented is written in :class:`SVDecode`; the paper's text available to us
(abstract, project page, third-party summaries) does not give the mask rule or μ's formula, so
both are our own closed forms, marked as such there and in ``docs/svdecode.md``. μ follows the
reading the sources support ("align to the *task* distribution", a "globally optimal" strength,
a calibration set): one scalar per warm start, the Gauss-Newton minimiser of the task labels'
cross-entropy under the steered logits over labelled warm-start examples (:meth:`SVDecode.calibrate`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
from torch import nn

from rankwise import configs, registry
from rankwise.core.ops import disable_adapters
from rankwise.engine.generation import ModelStream, Step, generate
from rankwise.errors import RankwiseError


@dataclass
class SVDecodeConfig:
    """Settings of :class:`SVDecode` (``decode.steer.*``; the CLI's ``--steer-*`` flags fill them).

    Attributes:
        mask_ratio: τ of the confidence mask: a token is steered only where its warm probability
            is at least ``τ · max_j p_warm_j`` (0 = steer every token, 1 = only the warm top-1).
        strength: λ, a multiplier on the calibrated step μ* (0 = plain decoding, 1 = the
            Gauss-Newton minimiser of the labels' cross-entropy).
        max_mu: Upper clip of μ* (μ* = num / den blows up when the masked directions barely move
            the decoded distribution, i.e. the denominator is tiny).
        eps: Added to the Gauss-Newton denominator.
        mu: A fixed μ* (``--steer-mu``) instead of calibrating it; still clipped and scaled by λ.
        calib_examples: How many labelled warm-start examples :meth:`SVDecode.calibrate` reads
            (``--steer-calib``).
    """

    mask_ratio: float = configs.bounded(0.1, ge=0.0, le=1.0, hint=(
        "(--steer-mask: the fraction of the warm top-1 probability a token needs to be steered)"))
    strength: float = configs.bounded(1.0, ge=0, hint="(--steer-strength; 0 = plain decoding)")
    max_mu: float = configs.bounded(4.0, ge=0, hint="(--steer-max-mu)")
    eps: float = configs.bounded(1e-8, gt=0)
    mu: float | None = None
    calib_examples: int = configs.bounded(64, ge=1, hint=(
        "(--steer-calib: labelled warm-start examples that calibrate mu)"))

    def problems(self) -> list[str]:
        """None beyond the declared ranges (each naming its CLI flag); :class:`SVDecodeSteer`
        extends it."""
        return []


@dataclass
class SVDecodeSteer(SVDecodeConfig):
    """``decode.steer: {name: svdecode, from: RUN, ...}``: the registry kind ``steer``'s entry
    ``svdecode`` (``--steer svdecode``); the rest of the keys are :class:`SVDecodeConfig`'s.

    Attributes:
        name: The steering rule.
        from_: The warm-start adapter run on the same base (``from:``, ``--steer-from``) whose
            adapters on / off give P_warm / P_pre.
    """

    name: str = "svdecode"
    from_: str | None = None

    def problems(self) -> list[str]:
        """The warm-start run is required."""
        out = [] if self.from_ is not None else [
            "from: --steer svdecode needs --steer-from RUN (decode.steer.from): a warm-start "
            "adapter run (LoRA, prompt tuning, ...) on the same base model"]
        return out + super().problems()

    def rule(self) -> SVDecodeConfig:
        """The :class:`SVDecodeConfig` part."""
        return SVDecodeConfig(**{f.name: getattr(self, f.name) for f in fields(SVDecodeConfig)})


def build_svdecode(config: SVDecodeSteer) -> "SVDecode":
    """The kind ``steer``'s builder: an uncalibrated :class:`SVDecode` of ``config``."""
    return SVDecode(config.rule())


@dataclass
class MuFit:
    """What :meth:`SVDecode.calibrate` found (logged by the CLI and ``bench svdecode``).

    Attributes:
        mu_star: The unclipped Gauss-Newton minimiser ``Σ g_t / (Σ h_t + ε)``.
        mu: The step applied: ``λ · clip(μ*, 0, max_mu)``.
        clipped: ``"max"`` (μ* > max_mu), ``"zero"`` (μ* < 0: steering raises the labels' loss
            to first order, so it is switched off) or ``""``.
        tokens: Labelled positions the sums ran over.
        loss_plain: Mean cross-entropy of the labels under the decoded logits ``z``.
        loss_steered: The same under ``z + μ d``.
        token_clip_fraction: Share of positions whose own ratio ``g_t / h_t`` exceeds max_mu.
        step_rule_clip_fraction: Share of positions where the former per-step rule (the
            Gauss-Newton step of KL(p_w ‖ softmax(z_0 + μ d)) from ``z_0``) exceeds max_mu; the
            review measured 82-98 % on synthetic logits.
    """

    mu_star: float
    mu: float
    clipped: str
    tokens: int
    loss_plain: float
    loss_steered: float
    token_clip_fraction: float
    step_rule_clip_fraction: float

    def line(self) -> str:
        """One log line: μ*, the applied μ, whether it was clipped, and the losses."""
        clip = {"max": " (clipped at max_mu)", "zero": " (negative: steering off)"}.get(self.clipped, "")
        return (f"svdecode: mu* {self.mu_star:.4g}{clip}, applied mu {self.mu:.4g}, over "
                f"{self.tokens} labelled tokens; label CE {self.loss_plain:.4f} -> "
                f"{self.loss_steered:.4f}; per-token ratio above max_mu on "
                f"{100 * self.token_clip_fraction:.1f}% of tokens")


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
    * step size (**our reading; the paper says "globally optimal", Gauss-Newton, computed on a
      calibration set, but its formula was not available**): one scalar per warm start, the
      minimiser of the Gauss-Newton (here: exact second-order) model, around μ = 0, of the task
      labels' cross-entropy under the steered logits, summed over the labelled positions t of
      warm-start examples (:meth:`calibrate`)::

          L(μ) = Σ_t CE(y_t, softmax(z_t + μ d_t))
          g_t = d_t[y_t] − Σ p_t d_t,    h_t = Σ p_t d_t² − (Σ p_t d_t)²   (p_t = softmax(z_t))
          μ* = Σ_t g_t / (Σ_t h_t + ε)

      (``−L'(0) = Σ g``, ``L''(0) = Σ h = Σ d_tᵀ F(p_t) d_t``, F the softmax Fisher), then
      ``μ = λ · clip(μ*, 0, μ_max)``. It is taken at the decoded logits ``z``, where it is applied
      (an earlier version took the KL step from ``z_0`` towards ``p_w`` and added it at ``z_w``,
      where that objective is already 0).
    * steered logits::

          z' = z + μ d

    λ = 0 gives ``z' = z`` exactly (plain decoding). At decode time everything is a closed form
    of the three logit vectors and the calibrated scalar: :meth:`steer` runs under
    ``torch.no_grad`` and creates no parameter.
    """

    def __init__(self, config: SVDecodeConfig | None = None) -> None:
        """Raises RankwiseError on a config value outside its range (every one, in one line)."""
        self.config = config or SVDecodeConfig()
        bad = configs.problems_of(self.config)
        if bad:
            raise RankwiseError("svdecode " + "; ".join(bad))
        self.fit: MuFit | None = None
        if self.config.mu is not None:
            self.fit = self._fit(float(self.config.mu), 0, float("nan"), float("nan"), float("nan"),
                                 float("nan"))

    def mask(self, p_warm: torch.Tensor) -> torch.Tensor:
        """``m`` (bool, same shape): tokens with ``p_w ≥ τ · max p_w`` along the last dim."""
        top = p_warm.max(dim=-1, keepdim=True).values
        return p_warm >= self.config.mask_ratio * top

    def direction(self, z_warm: torch.Tensor, z_pre: torch.Tensor) -> torch.Tensor:
        """``d = m ⊙ (p_w − p_0)`` in at least float32 (any leading batch dims)."""
        dt = torch.promote_types(z_warm.dtype, torch.float32)
        p_w, p_0 = torch.softmax(z_warm.to(dt), -1), torch.softmax(z_pre.to(dt), -1)
        delta = p_w - p_0
        return torch.where(self.mask(p_w), delta, torch.zeros_like(delta))

    @property
    def mu(self) -> float:
        """The applied step ``λ · clip(μ*, 0, μ_max)``.

        Raises:
            RankwiseError: Neither calibrated nor given a fixed ``mu``.
        """
        if self.config.strength == 0:
            return 0.0
        if self.fit is None:
            raise RankwiseError("SVDecode's mu is not set: calibrate it on labelled warm-start "
                                "examples (SVDecode.calibrate) or pass a fixed --steer-mu")
        return self.fit.mu

    def _fit(self, mu_star: float, tokens: int, plain: float, steered: float, tok_clip: float,
             rule_clip: float) -> MuFit:
        c = self.config
        clipped = "max" if mu_star > c.max_mu else "zero" if mu_star < 0 else ""
        return MuFit(mu_star, c.strength * min(max(mu_star, 0.0), c.max_mu), clipped, tokens,
                     plain, steered, tok_clip, rule_clip)

    @torch.no_grad()
    def calibrate(self, model: nn.Module, examples: Any, warm: nn.Module | None = None,
                  device: str = "cpu") -> MuFit:
        """Set μ from labelled warm-start examples (teacher forcing; see the class docstring).

        Args:
            model: The model decoded (its logits are ``z``).
            examples: Items with ``input_ids`` and optional ``labels`` (−100 = not a target;
                default: the ids themselves), e.g. the warm-start run's training data; the first
                ``calib_examples`` are read.
            warm: The warm-start model (adapters on / off give ``p_w`` / ``p_0``); ``None``:
                ``model``.
            device: Where the ids go.

        Returns:
            The :class:`MuFit` (also kept as ``self.fit``).

        Raises:
            RankwiseError: No labelled position among the examples.
        """
        warm_model = model if warm is None else warm
        c, num, den, n, ce0, zs = self.config, 0.0, 0.0, 0, [], []
        tok_mu, rule_mu = [], []
        for k in range(min(c.calib_examples, len(examples))):
            ex = examples[k]
            ids = list(ex["input_ids"])
            labels = ids if ex.get("labels") is None else list(ex["labels"])
            x = torch.tensor([ids], dtype=torch.long, device=device)
            y = torch.tensor(labels[1:], dtype=torch.long, device=device)  # position t predicts t + 1
            keep = y != -100
            if not bool(keep.any()):
                continue
            z = _teacher_logits(model, x, False)[:-1][keep]                # (N, V)
            z_w = z if warm is None else _teacher_logits(warm_model, x, False)[:-1][keep]
            z_0 = _teacher_logits(warm_model, x, True)[:-1][keep]
            y, d = y[keep], self.direction(z_w, z_0)
            p = torch.softmax(z.to(d.dtype), -1)
            pd = (p * d).sum(-1)
            g = d.gather(-1, y[:, None])[:, 0] - pd                          # −∂CE/∂μ per token
            h = (p * d * d).sum(-1) - pd ** 2                                # ∂²CE/∂μ² per token
            num, den, n = num + float(g.sum()), den + float(h.sum()), n + len(y)
            tok_mu.append(g / (h.clamp_min(0.0) + c.eps))
            p_0 = torch.softmax(z_0.to(d.dtype), -1)
            delta = torch.softmax(z_w.to(d.dtype), -1) - p_0
            p0d = (p_0 * d).sum(-1)
            rule_mu.append((d * delta).sum(-1) / ((p_0 * d * d).sum(-1) - p0d ** 2 + c.eps))
            zs.append((z, d, y))
        if not n:
            raise RankwiseError("SVDecode calibration found no labelled token in the warm-start "
                                "examples; give examples with completions (or pass --steer-mu)")
        mu_star = num / (max(den, 0.0) + c.eps)
        fit = self._fit(mu_star, n, 0.0, 0.0, float((torch.cat(tok_mu) > c.max_mu).float().mean()),
                        float((torch.cat(rule_mu) > c.max_mu).float().mean()))
        for z, d, y in zs:
            ce0.append(float(torch.nn.functional.cross_entropy(z.to(d.dtype), y, reduction="sum")))
            fit.loss_steered += float(torch.nn.functional.cross_entropy(
                z.to(d.dtype) + fit.mu * d, y, reduction="sum")) / n
        fit.loss_plain = sum(ce0) / n
        self.fit = fit
        return fit

    @torch.no_grad()
    def steer(self, z: torch.Tensor, z_warm: torch.Tensor, z_pre: torch.Tensor) -> torch.Tensor:
        """The steered logits ``z + μ (m ⊙ (p_w − p_0))`` (computed in at least float32,
        returned in ``z``'s dtype; any leading batch dims).

        Raises:
            RankwiseError: μ neither calibrated nor fixed (and λ ≠ 0).
        """
        if self.config.strength == 0:
            return z
        d = self.direction(z_warm, z_pre)
        return (z.to(d.dtype) + self.mu * d).to(z.dtype)


def _teacher_logits(model: nn.Module, x: torch.Tensor, adapters_off: bool) -> torch.Tensor:
    """Logits ``(T, V)`` of one uncached forward over ``x`` ``(1, T)`` (adapters on or off); a
    prompt-tuning prefix's own positions, if any are returned, are dropped."""
    ctx = disable_adapters(model) if adapters_off else contextlib.nullcontext()
    with ctx:
        out = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0]
    return out[-x.shape[1]:]


class SteerHook:
    """SVDecode as a logits hook of the one decode loop (:func:`rankwise.engine.generation.decode`):
    the loop's logits are ``z``; the hook runs the warm model (adapters on, when it is another
    model than the one decoded) and the base (the warm model with its adapters off), each a
    :class:`~rankwise.engine.generation.ModelStream` with its own KV cache, and returns
    ``steer.steer(z, z_w, z_0)``.

    Args:
        steer: The update (calibrated, or with a fixed μ).
        model: The model decoded.
        warm: The warm-start model; ``None``: ``model`` itself.

    Raises:
        RankwiseError: μ neither calibrated nor fixed (and λ ≠ 0), before any forward.
    """

    def __init__(self, steer: SVDecode, model: nn.Module, warm: nn.Module | None = None) -> None:
        steer.mu  # noqa: B018 -- refuses an uncalibrated step before any forward
        self.steer = steer
        warm_model = model if warm is None else warm
        self.warm = ModelStream(warm) if warm is not None and steer.config.strength != 0 else None
        self.pre = (ModelStream(warm_model, lambda: disable_adapters(warm_model))
                    if steer.config.strength != 0 else None)

    def __call__(self, step: Step, logits: torch.Tensor) -> torch.Tensor:
        """The steered ``(B, V)`` logits of this step (``logits`` itself when λ = 0)."""
        if self.pre is None:
            return logits
        z_warm = self.warm.logits(step) if self.warm is not None else logits
        return self.steer.steer(logits, z_warm, self.pre.logits(step))


def steered_generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_id: int,
                     steer: SVDecode, warm: nn.Module | None = None, temperature: float = 0.0,
                     top_p: float = 1.0, device: str = "cpu",
                     on_step: Callable[[torch.Tensor], Any] | None = None) -> list[int]:
    """Decode ``prompt_ids`` with SVDecode: the one decode loop with a :class:`SteerHook`.

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
        on_step: Receives the steered ``(V,)`` logits of every step (tests, scores).

    Returns:
        The new token ids.

    Raises:
        RankwiseError: μ neither calibrated nor fixed (and λ ≠ 0).
    """
    hooks: list[Any] = [SteerHook(steer, model, warm)]
    if on_step is not None:
        def watch(step: Step, z: torch.Tensor) -> torch.Tensor:
            on_step(z[0])                                           # (V,) of the one prompt
            return z
        hooks.append(watch)
    return generate(model, prompt_ids, max_new_tokens, eos_id, eos_id, temperature, top_p, device,
                    hooks=hooks)


registry.register("steer", "svdecode", SVDecodeSteer, build_svdecode,
                  summary="SVDecode: logits steered by the warm-start run's shift from the base (--steer-from)")

__all__ = ["MuFit", "SVDecode", "SVDecodeConfig", "SVDecodeSteer", "SteerHook", "build_svdecode",
           "steered_generate"]
