"""The DPO loss family: TRL 1.16's ``DPOTrainer`` loss types on sequence log-probabilities.

Every loss reads, per pair, the completion log-probs of the policy and of the reference (summed
over the completion tokens) and the completions' token counts. With the log-ratios
``r_w = log pi(y_w|x) - log pi_ref(y_w|x)`` and ``r_l`` (rejected), ``h = r_w - r_l``, ``beta``
and ``eps = label_smoothing``, each function below returns the loss of every pair ``(B,)``; the
step loss is their mean over the pairs (:func:`dpo_losses` sums a weighted list of them, TRL's
``loss_type`` list with ``loss_weights``). Each function names its paper and equation (the
equation where TRL's code or paper index names it, else the section), and where TRL 1.16 differs
from the paper the docstring says so: rankwise follows TRL.

Two losses depend on the batch, as in TRL: ``aot`` / ``aot_unpaired`` sort across the pairs of
one forward, and ``sft`` is the mean over one forward's chosen tokens. Under gradient
accumulation and torchrun a forward is a micro-batch of one process (TRL's per-device batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class Pairs:
    """The per-pair numbers every loss reads.

    Attributes:
        policy: ``(B, 2)`` completion log-probs of the trained model (chosen, rejected).
        reference: ``(B, 2)`` the same under the reference.
        lengths: ``(B, 2)`` completion tokens of each side.
        beta: ``beta``.
        label_smoothing: ``eps`` (read by :data:`SMOOTHED` losses only).
        discopop_tau: DiscoPOP's temperature ``tau``.
    """

    policy: torch.Tensor
    reference: torch.Tensor
    lengths: torch.Tensor
    beta: float
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05

    @property
    def ratios(self) -> torch.Tensor:
        """``(B, 2)`` log-ratios ``[r_w, r_l]``."""
        return self.policy - self.reference

    @property
    def h(self) -> torch.Tensor:
        """``(B,)`` ``r_w - r_l``."""
        r = self.ratios
        return r[:, 0] - r[:, 1]

    @property
    def per_token_h(self) -> torch.Tensor:
        """``(B,)`` ``r_w / |y_w| - r_l / |y_l|`` (each log-ratio over its completion tokens)."""
        per_token = self.ratios / self.lengths.clamp(min=1.0)      # (B, 2)
        return per_token[:, 0] - per_token[:, 1]


def _smoothed_logistic(z: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def sigmoid(p: Pairs) -> torch.Tensor:
    """DPO: Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly
    a Reward Model", eq. 7: ``-log sigma(beta h)``. With ``eps > 0``, conservative DPO (Mitchell
    2023, "A note on DPO with noisy preferences and relationship to IPO"):
    ``-(1 - eps) log sigma(beta h) - eps log sigma(-beta h)``. TRL 1.16's ``sigmoid`` no longer
    reads ``label_smoothing`` (its ``robust`` does); at ``eps = 0`` the two are one loss."""
    return _smoothed_logistic(p.beta * p.h, p.label_smoothing)


def hinge(p: Pairs) -> torch.Tensor:
    """SLiC: Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with Human Feedback",
    §2 (the calibration loss on the reference-normalised likelihood, as RSO, Liu et al. 2023, uses
    it): ``max(0, 1 - beta h)``; ``1 / beta`` is the margin."""
    return torch.relu(1 - p.beta * p.h)


def ipo(p: Pairs) -> torch.Tensor:
    """IPO: Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", eq. 17: ``(h' - 1 / (2 beta))^2`` (``beta`` is the paper's ``tau``), where
    ``h'`` divides each log-ratio by its completion tokens: TRL's normalisation, which the IPO
    authors confirmed to TRL; the paper is silent on it."""
    return (p.per_token_h - 1 / (2 * p.beta)) ** 2


def robust(p: Pairs) -> torch.Tensor:
    """rDPO: Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language Models with Noisy
    Feedback", §3.1: the unbiased loss under labels flipped with probability ``eps``,
    ``[-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)] / (1 - 2 eps)``."""
    z, eps = p.beta * p.h, p.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def exo_pair(p: Pairs) -> torch.Tensor:
    """EXO (pairwise): Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model
    Alignment", eq. 16: ``KL(q || [1 - eps, eps])`` with ``q = [sigma(beta h), sigma(-beta h)]``,
    ``= q_w (log q_w - log(1 - eps)) + q_l (log q_l - log eps)``; needs ``eps > 0`` (the paper
    uses 1e-3)."""
    z = p.beta * p.h
    eps = torch.tensor(p.label_smoothing, device=z.device, dtype=z.dtype)
    return (torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps))
            + torch.sigmoid(-z) * (F.logsigmoid(-z) - torch.log(eps)))


def nca_pair(p: Pairs) -> torch.Tensor:
    """NCA (pairwise): Chen et al. 2024, "Noise Contrastive Alignment of Language Models with
    Explicit Rewards", §4.1: with ``s = beta r``,
    ``-log sigma(s_w) - 1/2 log sigma(-s_w) - 1/2 log sigma(-s_l)`` (absolute, not relative,
    likelihoods)."""
    s = p.beta * p.ratios                                           # (B, 2)
    return -F.logsigmoid(s[:, 0]) - 0.5 * F.logsigmoid(-s[:, 0]) - 0.5 * F.logsigmoid(-s[:, 1])


def bco_pair(p: Pairs) -> torch.Tensor:
    """BCO (pairwise): Jung et al. 2024, "Binary Classifier Optimization for Large Language Model
    Alignment", §4: chosen classified 1 and rejected 0 by the implicit reward,
    ``-log sigma(beta r_w - delta) - log sigma(-(beta r_l - delta))``. TRL 1.16 sets the reward
    shift ``delta = 0`` (the paper, and TRL before 1.0, keep a running mean of the rewards as
    ``delta``); rankwise follows TRL 1.16."""
    s = p.beta * p.ratios                                           # (B, 2)
    return -F.logsigmoid(s[:, 0]) - F.logsigmoid(-s[:, 1])


def sppo_hard(p: Pairs) -> torch.Tensor:
    """SPPO with hard probabilities: Wu et al. 2024, "Self-Play Preference Optimization for
    Language Model Alignment", eq. 4.7 with the win probability set to 1 for the chosen and 0 for
    the rejected completion (the paper estimates it with PairRM; TRL's hard version):
    ``(r_w - 1/(2 beta))^2 + (r_l + 1/(2 beta))^2`` (``eta = 1 / beta``)."""
    r = p.ratios                                                    # (B, 2)
    return (r[:, 0] - 0.5 / p.beta) ** 2 + (r[:, 1] + 0.5 / p.beta) ** 2


def aot(p: Pairs) -> torch.Tensor:
    """AOT (paired): Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal
    Transport", §3: the policy's margins ``log pi(y_w) - log pi(y_l)`` and the reference's, each
    sorted over the batch, compared quantile by quantile through the (smoothed) logistic loss:
    ``delta = sort(m_pi) - sort(m_ref)``, ``-(1 - eps) log sigma(beta delta) - eps log
    sigma(-beta delta)``. Batch-dependent (larger batches help); one pair is DPO."""
    m_pi = p.policy[:, 0] - p.policy[:, 1]
    m_ref = p.reference[:, 0] - p.reference[:, 1]
    delta = torch.sort(m_pi, dim=0).values - torch.sort(m_ref, dim=0).values
    return _smoothed_logistic(p.beta * delta, p.label_smoothing)


def aot_unpaired(p: Pairs) -> torch.Tensor:
    """AOT (unpaired): Melnyk et al. 2024 (as :func:`aot`), §3: the chosen and the rejected
    log-ratios sorted separately, ``delta = sort(r_w) - sort(r_l)``, through the same smoothed
    logistic loss. TRL 1.16's ``aot_unpaired`` (TRL before 1.0 called it ``aot_pair``)."""
    r = p.ratios                                                    # (B, 2)
    delta = torch.sort(r[:, 0], dim=0).values - torch.sort(r[:, 1], dim=0).values
    return _smoothed_logistic(p.beta * delta, p.label_smoothing)


def apo_zero(p: Pairs) -> torch.Tensor:
    """APO-zero: D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive
    Revisions: Addressing Underspecification in Alignment", eq. 7 (raise the chosen likelihood,
    lower the rejected one; for chosen outputs better than the model's):
    ``1 - sigma(beta r_w) + sigma(beta r_l)``."""
    s = p.beta * p.ratios                                           # (B, 2)
    return 1 - torch.sigmoid(s[:, 0]) + torch.sigmoid(s[:, 1])


def apo_down(p: Pairs) -> torch.Tensor:
    """APO-down: D'Oosterlinck et al. 2024 (as :func:`apo_zero`), eq. 8 (lower both, the rejected
    more; for chosen outputs worse than the model's): ``sigma(beta r_w) + 1 - sigma(beta h)``."""
    return torch.sigmoid(p.beta * p.ratios[:, 0]) + 1 - torch.sigmoid(p.beta * p.h)


def discopop(p: Pairs) -> torch.Tensor:
    """DiscoPOP (log-ratio modulated loss): Lu et al. 2024, "Discovering Preference Optimization
    Algorithms with and for Large Language Models", eq. 5: with ``z = beta h`` and
    ``m = sigma(z / tau)``, ``(1 - m) (-log sigma(z)) + m exp(-z)`` (``tau = 0.05``, the paper's)."""
    z = p.beta * p.h
    m = torch.sigmoid(z / p.discopop_tau)
    return (1 - m) * -F.logsigmoid(z) + m * torch.exp(-z)


def sigmoid_norm(p: Pairs) -> torch.Tensor:
    """Length-normalised DPO: Lambert et al. 2024, "Tülu 3: Pushing Frontiers in Open Language
    Model Post-Training", §5 (its DPO objective): ``-log sigma(beta h')`` with each log-ratio
    divided by its completion tokens (``h'`` as in :func:`ipo`). TRL 1.16 names no paper for it."""
    return -F.logsigmoid(p.beta * p.per_token_h)


def sft(p: Pairs) -> torch.Tensor:
    """The negative log-likelihood of the chosen completions, as a term beside a preference loss
    (RPO, Pang et al. 2024, "Iterative Reasoning Preference Optimization", eq. 1 adds it to DPO;
    MPO, Wang et al. 2024, "Enhancing the Reasoning Ability of Multimodal Large Language Models
    via Mixed Preference Optimization", weighs ``[sigmoid, bco_pair, sft]`` by 0.8, 0.2, 1). As
    TRL 1.16: the mean over the forward's chosen tokens, ``-sum(log pi(y_w)) / sum(|y_w|)``, the
    same value for every pair (RPO divides each pair's sum by ``|x| + |y_w|``)."""
    nll = -p.policy[:, 0].sum() / p.lengths[:, 0].sum().clamp(min=1.0)
    return nll.expand(p.policy.shape[0])


LOSS_FUNCTIONS: dict[str, Callable[[Pairs], torch.Tensor]] = {
    f.__name__: f for f in (sigmoid, ipo, hinge, robust, exo_pair, nca_pair, bco_pair, sppo_hard, aot,
                            aot_unpaired, apo_zero, apo_down, discopop, sigmoid_norm, sft)}
LOSSES = tuple(LOSS_FUNCTIONS)
SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")  # read label_smoothing


def dpo_losses(policy: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor,
               loss: str | Sequence[str], beta: float, label_smoothing: float = 0.0,
               weights: Sequence[float] | None = None, discopop_tau: float = 0.05
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair losses (one loss, or a weighted sum of several) and implicit rewards.

    Args:
        policy: ``(B, 2)`` completion log-probs of the trained model (chosen, rejected).
        reference: ``(B, 2)`` the same under the reference.
        lengths: ``(B, 2)`` completion tokens.
        loss: One of :data:`LOSSES`, or a list of them (TRL's ``loss_type`` list).
        beta: ``beta``.
        label_smoothing: ``eps`` of the :data:`SMOOTHED` losses.
        weights: One weight per loss (TRL's ``loss_weights``); default 1 each.
        discopop_tau: DiscoPOP's ``tau``.

    Returns:
        ``(losses (B,), rewards (B, 2))``: ``sum_k w_k loss_k`` per pair (whose mean over the
        pairs is TRL's ``sum_k w_k mean(loss_k)``) and ``rewards = beta * (policy - reference)``.

    Raises:
        ValueError: An unknown loss, or weights whose count is not the losses'.
    """
    names = [loss] if isinstance(loss, str) else list(loss)
    weights = [1.0] * len(names) if weights is None else list(weights)
    if len(weights) != len(names):
        raise ValueError(f"dpo loss_weights: got {len(weights)} weights for {len(names)} losses")
    unknown = [n for n in names if n not in LOSS_FUNCTIONS]
    if unknown or not names:
        raise ValueError(f"dpo.loss: got {loss!r}; expected one of {LOSSES} or a list of them")
    pairs = Pairs(policy, reference, lengths, beta, label_smoothing, discopop_tau)
    out = sum(w * LOSS_FUNCTIONS[n](pairs) for n, w in zip(names, weights))
    return out, beta * pairs.ratios.detach()


__all__ = ["LOSSES", "LOSS_FUNCTIONS", "Pairs", "SMOOTHED", "dpo_losses"]
