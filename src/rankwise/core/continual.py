"""The maths of HRM-PET (Wei et al. 2025, "Hybrid Re-Matching for Continual Learning with
Parameter-Efficient Tuning", code github.com/wei-cheng777/HRM-PET): one parameter-efficient
module per task on a frozen model, chosen at inference by matching, then corrected by the
hybrid re-matching; trained with the cross-task instance-relationship distillation (CTIRD).

Method-agnostic tensor functions (``rankwise continual`` wires them to the modules,
:mod:`rankwise.recipes.continual`; docs/continual.md):

* :func:`task_keys` / :func:`match_keys`: the initial matching. A task's key is the mean of the
  L2-normalised frozen pooled features of its training examples; an example goes to the seen
  task whose key has the largest cosine with its frozen feature (L2P/CODA-style key-query
  matching with one key per task; the authors' code uses a separately trained task-identity
  classifier on the frozen features instead, a reading we do not reproduce).
* :func:`direct_rematch`: the class predicted with the matched module names a task; where that
  task is not the matched one, the example is run again with the predicted class's task module
  (code: ``prompt_id != lora_id``).
* :func:`confidence`, :func:`low_confidence`, :func:`confidence_rematch`: examples whose initial
  max-softmax probability is below ``tau`` (the code's ``--En msp`` rule) try candidate modules
  and keep the output with the largest confidence ``s(l) = T logsumexp(l / T)`` (T = 0.1 in the
  code: a smooth maximum logit).
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


def low_confidence(logits: torch.Tensor, tau: float) -> torch.Tensor:
    """``(n,)`` mask: max softmax probability below ``tau``."""
    return logits.softmax(-1).amax(-1) < tau


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
