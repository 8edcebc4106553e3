"""The maths of HRM-PET (Wei et al. 2025, "Hybrid Re-Matching for Continual Learning with
Parameter-Efficient Tuning", code github.com/wei-cheng777/HRM-PET): one parameter-efficient
module per task on a frozen model, chosen at inference by matching, then corrected by the
hybrid re-matching; trained with the cross-task instance-relationship distillation (CTIRD).

Method-agnostic tensor functions (``rankwise continual`` wires them to the modules,
:mod:`rankwise.commands.continual.run`; docs/continual.md):

* :func:`task_keys` / :func:`match_keys`: initial matching by keys. A task's key is the mean
  of the L2-normalised frozen pooled features of its training examples; an example goes to the
  seen task whose key has the largest cosine with its frozen feature (L2P/CODA-style key-query
  matching with one key per task).
* :class:`TaskIdentity`: the authors' initial matcher (HiDe-Prompt's task-identity inference,
  TII): a linear classifier over all classes on the frozen features, trained task by task with
  the logits of other tasks' classes masked, then re-aligned on samples of per-class Gaussians
  of the frozen features (HiDe's classifier alignment; no stored examples); an example goes to
  the task of its argmax class over the seen classes (code: ``lora_id``).
* :func:`direct_rematch`: the class predicted with the matched module names a task; where that
  task is not the matched one, the example is run again with the predicted class's task module
  (code: ``prompt_id != lora_id``).
* :func:`confidence`, :func:`gate_score`, :func:`low_confidence`, :func:`confidence_rematch`:
  examples whose initial gate score is below ``tau`` try candidate modules and keep the output
  with the largest confidence ``s(l) = T logsumexp(l / T)`` (T = 0.1 in the code: a smooth
  maximum logit). Gate scores: ``gen`` (the code's default ``--En gen --tau -10``), the negated
  generalised entropy over the top ``M = 20`` probabilities with ``gamma = 0.1``,
  :func:`generalized_entropy`; ``msp``, the max softmax probability (``--En msp``).
  :func:`tune_threshold` picks ``tau`` on a validation split.
* :func:`relation_matrix` / :func:`relation_distillation`: CTIRD,
  ``P_ij = exp(cos(f_i, f_j)) / sum_k exp(cos(f_i, f_k))`` over the batch and
  ``L = (1/B) sum_i sum_j P_old_ij (log P_old_ij - log P_new_ij)`` (``F.kl_div(log P_new, P_old,
  "batchmean")``), the teacher features coming from earlier tasks' modules.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def task_keys(features: torch.Tensor, task_of: torch.Tensor, num_tasks: int) -> torch.Tensor:
    """``(num_tasks, d)`` keys: the mean of each task's L2-normalised features, normalised.

    Args:
        features: ``(n, d)`` frozen features.
        task_of: ``(n,)`` task index of each row.
        num_tasks: Number of tasks (a task without rows gets a zero key).
    """
    f = F.normalize(features.float(), dim=-1)
    keys = torch.zeros(num_tasks, f.shape[1], dtype=f.dtype)
    keys.index_add_(0, task_of.long(), f)
    return F.normalize(keys, dim=-1)


def match_keys(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``(n,)`` index of the key with the largest cosine similarity to each query."""
    return (F.normalize(queries.float(), dim=-1) @ F.normalize(keys.float(), dim=-1).T).argmax(-1)


def direct_rematch(matched: torch.Tensor, logits: torch.Tensor,
                   class_task: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Direct re-matching: ``(modules, switched)``.

    Args:
        matched: ``(n,)`` initially matched task per example.
        logits: ``(n, C)`` logits computed with each example's matched module.
        class_task: ``(C,)`` task of each class.

    Returns:
        The module to use (the predicted class's task) and the mask of examples where it
        differs from ``matched`` (those are run again).
    """
    predicted = class_task[logits.argmax(-1)]
    return predicted, predicted != matched


def confidence(logits: torch.Tensor, temperature: float = 0.1) -> torch.Tensor:
    """``T logsumexp(logits / T)`` over the last axis (the code's energy score; -inf entries
    are masked classes)."""
    return temperature * torch.logsumexp(logits / temperature, dim=-1)


GATES = ("gen", "msp")


def generalized_entropy(logits: torch.Tensor, gamma: float = 0.1, top: int = 20) -> torch.Tensor:
    """``(n,)`` GEN confidence ``-sum_{j in top M} p_j^gamma (1 - p_j)^gamma`` of ``softmax(l)``.

    The generalised entropy of Liu et al. 2023 ("GEN: pushing the limits of softmax-based
    out-of-distribution detection") over the ``M = top`` largest probabilities, negated so that
    larger means more confident; the HRM-PET code's ``generalized_entropy(softmax, 0.1, 20)``.
    Masked classes (``-inf`` logits, ``p = 0``) add 0. Its range over ``C`` classes is
    ``[-min(M, C) (1/C)^gamma (1 - 1/C)^gamma, 0]``: with 8 classes no score is below -6.4, so the
    code's ``tau = -10`` (set for 100-200 classes) never fires there.

    Args:
        logits: ``(n, C)`` logits.
        gamma: The exponent (code: 0.1).
        top: ``M``, probabilities summed (code: 20; all of them when fewer classes).
    """
    p = logits.double().softmax(-1)          # float64: tiny p^gamma terms stay exact
    q = p.topk(min(top, p.shape[-1]), dim=-1).values
    return -(q.pow(gamma) * (1 - q).pow(gamma)).sum(-1).float()


def gate_score(logits: torch.Tensor, gate: str = "gen") -> torch.Tensor:
    """``(n,)`` confidence of the initial prediction: ``gen`` (:func:`generalized_entropy`) or
    ``msp`` (max softmax probability)."""
    if gate == "gen":
        return generalized_entropy(logits)
    if gate == "msp":
        return logits.float().softmax(-1).amax(-1)
    raise ValueError(f"gate {gate!r}: expected one of {list(GATES)}")


def low_confidence(logits: torch.Tensor, tau: float, gate: str = "msp") -> torch.Tensor:
    """``(n,)`` mask: gate score (:func:`gate_score`) below ``tau``."""
    return gate_score(logits, gate) < tau


def tune_threshold(scores: torch.Tensor, right_if_rematched: torch.Tensor,
                   right_if_kept: torch.Tensor) -> tuple[float, float]:
    """The ``tau`` that maximises validation accuracy of the gate ``score < tau``.

    Accuracy is ``mean_i [score_i < tau ? right_if_rematched_i : right_if_kept_i]``; it only
    changes at the scores, so every distinct threshold is tried: below all scores (nothing
    re-matched), each midpoint between consecutive distinct scores, above all. Ties go to the
    smallest ``tau`` (the fewest re-matched examples).

    Args:
        scores: ``(n,)`` gate scores of the validation examples.
        right_if_rematched: ``(n,)`` bool, the confidence-based prediction is right.
        right_if_kept: ``(n,)`` bool, the prediction without it is right.

    Returns:
        ``(tau, validation accuracy at tau)``.
    """
    s = scores.double()
    u = s.unique()                                                     # sorted ascending
    cands = torch.cat([u[:1] - 1.0, (u[1:] + u[:-1]) / 2, u[-1:] + 1.0]) if len(u) else torch.zeros(1)
    fired = s[None, :] < cands[:, None]                                # (thresholds, n)
    acc = torch.where(fired, right_if_rematched.bool()[None], right_if_kept.bool()[None]).double().mean(-1)
    best = int(acc.argmax())                                           # first maximum: smallest tau
    return float(cands[best]), float(acc[best])


class TaskIdentity:
    """Task-identity inference on frozen features (HiDe-Prompt's TII, the HRM-PET code's
    initial matcher): a linear classifier ``W f + b`` over all classes.

    :meth:`learn_task` trains it on a task's frozen features with cross-entropy over that
    task's classes only (the other logits masked to ``-inf``, as the code's ``train_mask``, so
    other rows get no gradient); it then stores each class's feature mean and per-dimension
    variance. :meth:`align` (HiDe's classifier alignment, after every task but the first)
    re-trains the whole classifier on samples of ``N(mean_c, diag var_c)`` of every seen class,
    cross-entropy over the seen classes. Reading: the code's default keeps full covariances;
    we keep their diagonal (its ``variance`` option), which needs no ``d x d`` matrix per class.

    Args:
        dim: Feature size.
        num_classes: All classes of the run.
        seed: Seeds the initialisation and the Gaussian samples.
    """

    def __init__(self, dim: int, num_classes: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.gen = g
        self.linear = torch.nn.Linear(dim, num_classes)
        with torch.no_grad():
            bound = 1.0 / dim ** 0.5
            self.linear.weight.uniform_(-bound, bound, generator=g)
            self.linear.bias.zero_()
        self.stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``(n, C)`` logits of frozen features ``(n, dim)``."""
        with torch.no_grad():
            return self.linear(features.float())

    def _fit(self, draw, allowed: torch.Tensor, steps: int, lr: float) -> None:
        """``steps`` AdamW steps (one optimizer) on the batches ``draw() -> (x, y)``."""
        opt = torch.optim.AdamW(self.linear.parameters(), lr=lr, weight_decay=0.0)
        for _ in range(steps):
            x, y = draw()
            loss = F.cross_entropy(self.linear(x).masked_fill(~allowed, float("-inf")), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    def learn_task(self, features: torch.Tensor, labels: torch.Tensor, task_classes: torch.Tensor,
                   steps: int, lr: float) -> None:
        """Full-batch AdamW on one task's features, logits of other classes masked.

        Args:
            features: ``(n, dim)`` frozen features of the task's training examples.
            labels: ``(n,)`` their classes.
            task_classes: ``(C,)`` bool mask of the task's classes.
            steps: Optimizer steps.
            lr: Learning rate.
        """
        x = features.float()
        self._fit(lambda: (x, labels.long()), task_classes, steps, lr)
        for c in labels.unique().tolist():
            rows = x[labels == c]
            self.stats[c] = (rows.mean(0), rows.var(0, unbiased=False) + 1e-4)

    def align(self, seen: torch.Tensor, steps: int, lr: float, samples: int) -> None:
        """Classifier alignment: ``steps`` AdamW steps, each on ``samples`` fresh draws of every
        seen class's Gaussian, cross-entropy over the ``seen`` classes (a bool mask)."""
        classes = [c for c in sorted(self.stats) if bool(seen[c])]
        y = torch.tensor([c for c in classes for _ in range(samples)])

        def draw():
            xs = [m + v.sqrt() * torch.randn(samples, m.shape[0], generator=self.gen)
                  for m, v in (self.stats[c] for c in classes)]                 # (samples, dim) each
            return torch.cat(xs), y
        self._fit(draw, seen, steps, lr)

    def match(self, features: torch.Tensor, class_task: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """``(n,)`` task of the argmax class over the ``seen`` classes."""
        return class_task[self.logits(features).masked_fill(~seen, float("-inf")).argmax(-1)]


def candidate_tasks(logits: torch.Tensor, class_task: torch.Tensor, k: int) -> torch.Tensor:
    """``(n, k)`` tasks of the ``k`` highest-scoring classes of each row."""
    return class_task[logits.topk(k, dim=-1).indices]


def confidence_rematch(candidates: torch.Tensor, temperature: float = 0.1) -> torch.Tensor:
    """Confidence-based re-matching: ``(n,)`` index of the most confident candidate.

    Args:
        candidates: ``(n, m, C)`` logits of each example under each of ``m`` candidate modules.
    """
    return confidence(candidates, temperature).argmax(-1)


def relation_matrix(features: torch.Tensor) -> torch.Tensor:
    """``(B, B)`` instance relations: row-normalised ``exp`` of the pairwise cosine similarities
    (diagonal included, as in the code)."""
    f = F.normalize(features.float(), dim=-1)
    return (f @ f.T).softmax(-1)


def relation_distillation(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """CTIRD: ``KL(P_old || P_new)`` summed over the batch's pairs, divided by ``B``.

    Args:
        new: ``(B, d)`` features of the module being trained (gradients flow).
        old: ``(B, d)`` features of the same batch under an earlier task's module (teacher).
    """
    p_new = relation_matrix(new)
    p_old = relation_matrix(old.detach())
    return F.kl_div(p_new.log(), p_old, reduction="batchmean")
