"""GAIN-RL (``data.order: gain-rl``): GRPO's prompts ordered by angle concentration, drawn by a
Gaussian sampler whose centre moves with the policy's accuracy.

Wang et al. 2025, "Angles Don't Lie: Unlocking Training-Efficient RL Through the Model's Own
Signals" (arXiv 2506.02281). For a linear layer ``a = x W`` the gradient norm is
``sum_ij |x_i| |x_j| cos(theta_ij) <da_i, da_j>``, so prompts whose token hidden states point the
same way give larger gradients. The signal, per prompt, from ``X`` = the hidden states entering
the *last* layer's MLP (one forward of the prompt), rows L2-normalised, ``C = X X^T`` (cosines):

* ``reading: pairs`` (this module's default, the paper's intent as we read it): with ``p`` prefix
  tokens (``prefix_tokens``) and question tokens ``Q = [p, T - tail)``,
  ``intra = mean_{i > j in Q} C_ij`` (distinct question pairs) and
  ``inter = mean_{i in Q, j < p} C_ij`` (question to prefix); ``score = intra + w * inter``.
* ``reading: released``: the released code's arithmetic (``data_processor.py``), kept for
  comparison: ``M = C * tril(1, diagonal=1)``, ``score = mean(M[p:T-tail][p:L-tail]) +
  w * mean(M[p:T-tail][:p])`` where each ``[a:b][c:d]`` slices *rows twice* (``L`` = the rows
  after the first slice) and the means include the masked zeros.

Prompts are sorted by descending score. The sampler (released ``gainrl_trainer.py``): each loop
draws ``pool`` positions of the sorted list without replacement with
``p_i ~ exp(-((i - mu) / sigma)^2 / 2)``, ``mu_0 = 0``; after the loop
``mu <- mu + clamp(m tanh(2 (acc - 1/2)) + m tanh(2 ang), 0, 2 m)`` with ``acc`` = the loop's
mean reward / ``reward_max``, ``ang`` = the loop's mean signal, ``m = move * n`` and
``sigma = sigma * n`` (the released 500 and 1000 on 7,500 prompts, as fractions). ``mu`` is kept
inside ``[0, n - 1]`` for the weights (the released code lets it run past the end).
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from rankwise.engine.loop import split
from rankwise.errors import RankwiseError


def angle_signal(x: torch.Tensor, prefix: int = 0, tail: int = 0, inter_weight: float = 8.0,
                 reading: str = "pairs") -> float:
    """GAIN-RL's angle concentration of one prompt's hidden states ``x`` ``(T, d)`` (see the
    module docstring for the two readings)."""
    x = torch.nn.functional.normalize(x.float(), dim=-1)
    c = x @ x.T                                                     # (T, T) cosines
    t = c.shape[0]
    stop = t - tail
    if reading == "released":
        m = c * torch.tril(torch.ones_like(c), diagonal=1)
        rows = m[prefix:stop]
        intra, inter = rows[prefix:rows.shape[0] - tail], rows[:prefix]
        return _mean(intra) + inter_weight * _mean(inter)
    q = torch.arange(prefix, max(prefix, stop))
    intra = c[q][:, q]
    below = torch.tril(torch.ones_like(intra, dtype=torch.bool), diagonal=-1)
    inter = c[q][:, :prefix]
    return _mean(intra[below]) + inter_weight * _mean(inter)


def _mean(t: torch.Tensor) -> float:
    return float(t.mean()) if t.numel() else 0.0


def last_mlp(model: nn.Module) -> nn.Module:
    """The MLP of the last numbered block (``...layers.N.mlp`` / ``...h.N.mlp``).

    Raises:
        RankwiseError: The model has no ``<blocks>.<N>.mlp`` module.
    """
    best, found = -1, None
    for name, mod in model.named_modules():
        m = re.search(r"\.(\d+)\.mlp$", name)
        if m and int(m.group(1)) > best:
            best, found = int(m.group(1)), mod
    if found is None:
        raise RankwiseError("data.order: gain-rl reads the hidden states entering the last block's "
                            "MLP, and this model has no '<blocks>.<N>.mlp' module; use data.order: uniform")
    return found


@torch.no_grad()
def prompt_signals(model: nn.Module, prompts: list[list[int]], cfg: Any, device: str = "cpu") -> list[float]:
    """The angle signal of every prompt (one forward each, in eval mode)."""
    held: list[torch.Tensor] = []
    def grab(mod, args, kwargs):  # the MLP's input, passed by position or by name
        x = args[0] if args else next(iter(kwargs.values()))
        held.append(x.detach().reshape(-1, x.shape[-1]))            # (T, d) of the one prompt

    hook = last_mlp(model).register_forward_pre_hook(grab, with_kwargs=True)
    was = model.training
    model.eval()
    out = []
    try:
        for ids in prompts:
            held.clear()
            model(input_ids=torch.tensor([ids], device=device))
            out.append(angle_signal(held[-1], cfg.prefix_tokens, cfg.tail_tokens, cfg.inter_weight,
                                    cfg.reading))
    finally:
        hook.remove()
        model.train(was)
    return out


def centre_step(mu: float, acc: float, ang: float, move: float) -> float:
    """``mu + clamp(move tanh(2 (acc - 1/2)) + move tanh(2 ang), 0, 2 move)``."""
    step = move * math.tanh(2 * (acc - 0.5)) + move * math.tanh(2 * ang)
    return mu + min(max(step, 0.0), 2 * move)


class GainRLSampler:
    """The engine's ``schedule`` under ``data.order: gain-rl``: each step's prompts come from
    the Gaussian draw over the sorted data (see the module docstring); its state goes into
    checkpoints, so a resumed run draws the same prompts.

    Args:
        scores: Each training prompt's angle signal.
        cfg: The :class:`~rankwise.tasks.grpo.task.GainRLConfig`.
        grad_accum: Micro-batches per step.
        seed: Seeds each loop's draw (with the loop's number).
    """

    def __init__(self, scores: list[float], cfg: Any, grad_accum: int = 1, seed: int = 0) -> None:
        self.scores = [float(s) for s in scores]
        self.cfg, self.grad_accum, self.seed = cfg, grad_accum, seed
        n = len(self.scores)
        self.order = sorted(range(n), key=lambda i: -self.scores[i])  # descending signal
        self.mu, self.loop = 0.0, 0
        self.pool: list[int] = []
        self.acc_sum = self.ang_sum = 0.0
        self.acc_n = self.ang_n = 0
        self.history: list[float] = [0.0]

    def weights(self) -> torch.Tensor:
        """The Gaussian weights of the sorted positions around the centre."""
        n = len(self.order)
        pos = torch.arange(n, dtype=torch.float64)
        mu = min(max(self.mu, 0.0), n - 1)
        return torch.exp(-0.5 * ((pos - mu) / (self.cfg.sigma * n)) ** 2)

    def _new_loop(self, need: int) -> None:
        n = len(self.order)
        if self.acc_n:  # the loop that ended moves the centre
            acc = self.acc_sum / self.acc_n / self.cfg.reward_max
            ang = self.ang_sum / max(self.ang_n, 1)
            self.mu = centre_step(self.mu, acc, ang, self.cfg.move * n)
            self.history.append(self.mu)
        self.acc_sum = self.ang_sum = 0.0
        self.acc_n = self.ang_n = 0
        size = min(n, max(self.cfg.pool, need))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.loop)
        self.pool = torch.multinomial(self.weights(), size, replacement=False, generator=g).tolist()
        self.loop += 1

    def draw(self, k: int) -> list[int]:
        """The dataset indices of the next ``k`` prompts."""
        if len(self.pool) < k:
            self._new_loop(k)
        k = min(k, len(self.pool))
        take, self.pool = self.pool[:k], self.pool[k:]
        idx = [self.order[p] for p in take]
        self.ang_sum += sum(self.scores[i] for i in idx)
        self.ang_n += len(idx)
        return idx

    def micro_batches(self, dataset: Any, idx: list[int]) -> list[list[int]]:
        """The engine's hook: this step's ``len(idx)`` prompts, in ``grad_accum`` micro-batches."""
        return split(self.draw(len(idx)), self.grad_accum)

    def observe(self, rewards: list[float]) -> None:
        """The step's mean rewards (one per micro-batch), for the loop's accuracy."""
        self.acc_sum += sum(rewards)
        self.acc_n += len(rewards)

    def state_dict(self) -> dict:
        """Everything the next draws depend on."""
        return {"scores": self.scores, "mu": self.mu, "loop": self.loop, "pool": self.pool,
                "acc": [self.acc_sum, self.acc_n], "ang": [self.ang_sum, self.ang_n],
                "history": self.history}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.__init__(state["scores"], self.cfg, self.grad_accum, self.seed)
        self.mu, self.loop, self.pool = float(state["mu"]), int(state["loop"]), list(state["pool"])
        self.acc_sum, self.acc_n = float(state["acc"][0]), int(state["acc"][1])
        self.ang_sum, self.ang_n = float(state["ang"][0]), int(state["ang"][1])
        self.history = list(state["history"])


__all__ = ["angle_signal", "centre_step", "GainRLSampler", "last_mlp", "prompt_signals"]
