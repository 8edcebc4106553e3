"""GAIN-RL (``data.order: gain-rl``): GRPO's prompts ordered by angle concentration, drawn by a
Gaussian sampler whose centre moves with the policy's accuracy and online angle.

Wang et al. 2025, "Angles Don't Lie: Unlocking Training-Efficient RL Through the Model's Own
Signals" (arXiv 2506.02281). For a linear layer ``a = x W`` the gradient norm is
``sum_ij |x_i| |x_j| cos(theta_ij) <da_i, da_j>``, so prompts whose token hidden states point the
same way give larger gradients. The ordering score, per prompt, from ``X`` = the hidden states entering
the *last* layer's MLP (one forward of the prompt), rows L2-normalised, ``C = X X^T`` (cosines):

* ``reading: pairs`` (this module's default, the paper's intent as we read it): with ``p`` prefix
  tokens (``prefix_tokens``) and question tokens ``Q = [p, T - tail)``,
  ``intra = mean_{i > j in Q} C_ij`` (distinct question pairs) and
  ``inter = mean_{i in Q, j < p} C_ij`` (question to prefix); ``score = intra + w * inter``.
* ``reading: released``: the released code's arithmetic (``data_processor.py``), kept for
  comparison: ``M = C * tril(1, diagonal=1)``, ``score = mean(M[p:T-tail][p:L-tail]) +
  w * mean(M[p:T-tail][:p])`` where each ``[a:b][c:d]`` slices *rows twice* (``L`` = the rows
  after the first slice) and the means include the masked zeros.

Prompts are sorted by descending score (once, before training, under the starting model: the
released ``data_processor.py``). The sampler (released ``gainrl_trainer.py``): each loop draws
``pool`` positions of the sorted list without replacement with
``p_i ~ exp(-((i - mu) / sigma)^2 / 2)``, ``mu_0 = 0``; after the loop
``mu <- mu + clamp(m tanh(2 (acc - 1/2)) + m tanh(2 ang), 0, 2 m)`` with ``acc`` = the loop's
mean reward / ``reward_max``, ``m = move * n`` and ``sigma = sigma * n`` (the released 500 and
1000 on 7,500 prompts, as fractions). ``mu`` is kept inside ``[0, n - 1]`` for the weights (the
released code lets it run past the end).

``ang`` is the *online* angle of the released trainer (``trl_gainrl/trl/trainer/grpo_trainer.py``
``get_per_token_logps``; ``verl_gainrl/.../dp_actor.py``): in every training forward of the
policy (:meth:`rankwise.tasks.grpo.task.GRPOTask.loss_sum`) the hidden states entering the last
block's MLP over each row's prompt + completion, padding dropped (verl's unpadded rows; the trl
release's one-row mini-batches still carry the batch's padding), rows L2-normalised, ``C = X X^T``,
and per row one plain mean cosine (:func:`online_angle`): no prefix split and no inter weight.
``reading: pairs``: the mean over distinct pairs ``i > j``; ``reading: released``: the released
``sum(C * tril(1, diagonal=1)) / count_nonzero(...)`` (diagonal and super-diagonal included).
``ang`` = the mean over the loop's completion rows (the released mean over prompts of the mean
over their completions, with equal groups). So the centre holds while the policy fails (at
``acc = 0`` the step is ``m (tanh(2 ang) - 0.762) < 0`` for any cosine ``ang < 0.5``) and moves
with the current policy's angles, not with the fixed ordering score.
"""
from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Iterator

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


@contextlib.contextmanager
def mlp_inputs(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the input of the last block's MLP (:func:`last_mlp`) of every forward run inside
    the ``with`` block, detached, as ``(B, T, d)`` (or however the model shapes it).

    Raises:
        RankwiseError: The model has no ``<blocks>.<N>.mlp`` module.
    """
    held: list[torch.Tensor] = []
    def grab(mod, args, kwargs):  # the MLP's input, passed by position or by name
        held.append((args[0] if args else next(iter(kwargs.values()))).detach())

    hook = last_mlp(model).register_forward_pre_hook(grab, with_kwargs=True)
    try:
        yield held
    finally:
        hook.remove()


@torch.no_grad()
def prompt_signals(model: nn.Module, prompts: list[list[int]], cfg: Any, device: str = "cpu") -> list[float]:
    """The ordering score of every prompt (one forward each, in eval mode)."""
    was = model.training
    model.eval()
    out = []
    try:
        with mlp_inputs(model) as held:
            for ids in prompts:
                held.clear()
                model(input_ids=torch.tensor([ids], device=device))
                x = held[-1].reshape(-1, held[-1].shape[-1])        # (T, d) of the one prompt
                out.append(angle_signal(x, cfg.prefix_tokens, cfg.tail_tokens, cfg.inter_weight,
                                        cfg.reading))
    finally:
        model.train(was)
    return out


def online_angle(x: torch.Tensor, reading: str = "pairs") -> float:
    """The released trainer's online angle of one row: its mean token cosine.

    Args:
        x: The row's hidden states ``(T, d)`` (prompt + completion, no padding).
        reading: ``pairs``: the mean over distinct pairs ``i > j``; ``released``:
            ``sum(C * tril(1, 1)) / count_nonzero(C * tril(1, 1))`` (diagonal and super-diagonal
            in, as the released trainer computes it).

    Returns:
        The mean cosine (0 for a row with no pair).
    """
    x = torch.nn.functional.normalize(x.float(), dim=-1)
    c = x @ x.T                                                     # (T, T) cosines
    if reading == "released":
        m = c * torch.tril(torch.ones_like(c), diagonal=1)
        return float(m.sum() / torch.count_nonzero(m).clamp(min=1))
    return _mean(c[torch.tril(torch.ones_like(c, dtype=torch.bool), diagonal=-1)])


def row_angles(hidden: torch.Tensor, attention_mask: torch.Tensor, reading: str = "pairs") -> list[float]:
    """:func:`online_angle` of every row of a training forward.

    Args:
        hidden: The last block's MLP input ``(R, T, d)`` (:func:`mlp_inputs`; a prompt method's
            leading virtual tokens, ``(R, v + T, d)``, are left out).
        attention_mask: ``(R, T)``; positions at 0 (padding) are dropped.
        reading: :func:`online_angle`'s reading.

    Returns:
        One angle per row.
    """
    keep = attention_mask.bool()
    hidden = hidden[:, hidden.shape[1] - keep.shape[1]:]            # (R, T, d): virtual tokens lead
    return [online_angle(hidden[r][keep[r]], reading) for r in range(hidden.shape[0])]


def centre_step(mu: float, acc: float, ang: float, move: float) -> float:
    """``mu + clamp(move tanh(2 (acc - 1/2)) + move tanh(2 ang), 0, 2 move)``."""
    step = move * math.tanh(2 * (acc - 0.5)) + move * math.tanh(2 * ang)
    return mu + min(max(step, 0.0), 2 * move)


class GainRLSampler:
    """The engine's ``schedule`` under ``data.order: gain-rl``: each step's prompts come from
    the Gaussian draw over the sorted data (see the module docstring), and the centre moves on
    the loop's accuracy (:meth:`observe`) and online angle (:meth:`observe_angles`); its state
    goes into checkpoints, so a resumed run draws the same prompts.

    Args:
        scores: Each training prompt's ordering score (:func:`prompt_signals`).
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
        return [self.order[p] for p in take]

    def micro_batches(self, dataset: Any, idx: list[int]) -> list[list[int]]:
        """The engine's hook: this step's ``len(idx)`` prompts, in ``grad_accum`` micro-batches."""
        return split(self.draw(len(idx)), self.grad_accum)

    def observe(self, rewards: list[float]) -> None:
        """The step's mean rewards (one per micro-batch), for the loop's accuracy."""
        self.acc_sum += sum(rewards)
        self.acc_n += len(rewards)

    def observe_angles(self, angles: list[float]) -> None:
        """The online angles of a training forward's rows (:func:`row_angles`), for the loop's
        ``ang``."""
        self.ang_sum += sum(angles)
        self.ang_n += len(angles)

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


__all__ = ["angle_signal", "centre_step", "GainRLSampler", "last_mlp", "mlp_inputs", "online_angle",
           "prompt_signals", "row_angles"]
