"""The generalized Jensen-Shannon divergence of GKD, per completion token.

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (ICLR 2024), eq. 1. With the teacher's next-token distribution ``P`` and the
student's ``Q`` at one position, and ``M = beta P + (1 - beta) Q``::

    D_JSD(beta)(P || Q) = beta KL(P || M) + (1 - beta) KL(Q || M)

TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` (and the chunked loss of its
``DistillationTrainer``) takes this at ``0 < beta < 1`` and, at the two ends, the limits the
paper names instead of the value of eq. 1 (which is 0 there): ``beta = 0`` is the forward KL
``KL(P || Q)`` (supervised KD, mode covering) and ``beta = 1`` the reverse KL ``KL(Q || P)``
(mode seeking). We follow TRL. Both distributions are ``softmax(logits / temperature)``.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """The divergence of the student's next-token distribution from the teacher's at each row.

    Args:
        student_logits: ``(N, V)`` logits at the completion positions (with gradient).
        teacher_logits: ``(N, V)`` the teacher's at the same positions.
        beta: In ``[0, 1]``: 0 forward KL, 1 reverse KL, else the generalized JSD (module
            docstring).
        temperature: Both logits are divided by it before the softmax.

    Returns:
        ``(N,)`` float32 divergences (nats), summed over the vocabulary.
    """
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)     # (N, V) log Q
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)     # (N, V) log P
    if beta == 0:
        kl = F.kl_div(student, teacher, reduction="none", log_target=True)   # P (log P - log Q)
    elif beta == 1:
        kl = F.kl_div(teacher, student, reduction="none", log_target=True)   # Q (log Q - log P)
    else:
        b = torch.tensor(beta, dtype=student.dtype, device=student.device)
        mixture = torch.logsumexp(torch.stack([student + torch.log1p(-b), teacher + torch.log(b)]), dim=0)
        kl = (b * F.kl_div(mixture, teacher, reduction="none", log_target=True)
              + (1 - b) * F.kl_div(mixture, student, reduction="none", log_target=True))
    return kl.sum(-1)


__all__ = ["generalized_jsd"]
