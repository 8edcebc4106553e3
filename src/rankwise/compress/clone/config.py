"""Config of ``rankwise distill`` (Low-Rank Clone): the only place its defaults live."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rankwise.compress.config import HeldoutConfig, TextConfig
from rankwise.configs import bounded, problems_of


@dataclass
class DistillConfig:
    """Low-Rank Clone distillation of a frozen teacher into a narrower student.

    Attributes:
        student_hidden: The student's hidden size ``d_s`` (below the teacher's ``d_t``; the CLI's
            ``--student-hidden``). Heads, head size, FFN width, depth and vocabulary are the
            teacher's.
        temperature: ``T`` of the KL term: 40, the authors' published run (the README's
            command); the code's argparse default is 10.
        kl_weight: Weight of ``KL(p_t^T ‖ p_s^T)`` (the code adds it with weight 1, no ``T²``).
        kl_reduction: ``sequence``: the KL summed over each window's positions and averaged
            over windows (the released code's ``kl_div(..., reduction="batchmean")`` on
            ``(B, L, V)`` logits; at ``T = 40`` and windows of ``L`` tokens its per-token weight
            is ``L/T²``); ``token``: averaged over tokens (1/L of that).
        init: ``svd`` (ours: one orthonormal basis from the teacher embedding's SVD, norm
            weights folded in; it starts far better than a random start in ``bench distill``)
            or ``normal`` (the released code's: projections N(0, 0.02), norms at 1).
        clone_weight: Weight of the summed activation-clone MSE terms (the code's
            ``aux_loss_scale_factor`` 0.2).
        tie_head_projection: One projection for the embedding and the output head (the code's
            ``tie_word_emb_proj``); ``false`` trains a second one for the head.
        steps: Optimizer steps.
        batch: Windows per step.
        lr: AdamW learning rate of the projections and student norms (the best of 1e-3 and
            3e-3 in `bench distill`).
        weight_decay: AdamW weight decay.
        warmup_fraction: Linear warm-up share of the steps, then linear decay to 0.
        grad_clip: Max gradient norm (0 = off).
        seed: Seeds the batch order (and ``init: normal``).
        eval_every: Held-out perplexity every N steps (0 = only at the end).
        checkpoint_every: Checkpoint every N steps (0 = only at the end).
        data: Training windows (default: the standard library's training modules, read with
            the teacher's tokenizer, or as bytes when the teacher folder has none).
        heldout: Held-out windows for perplexity (default: the held-out stdlib modules).
    """

    student_hidden: int = 0
    temperature: float = bounded(40.0, gt=0)
    kl_weight: float = bounded(1.0, ge=0)
    kl_reduction: Literal["sequence", "token"] = "sequence"
    init: Literal["svd", "normal"] = "svd"
    clone_weight: float = bounded(0.2, ge=0)
    tie_head_projection: bool = True
    steps: int = bounded(200, ge=1)
    batch: int = bounded(8, ge=1)
    lr: float = bounded(1e-3, gt=0)
    weight_decay: float = bounded(0.0, ge=0)
    warmup_fraction: float = bounded(0.1, ge=0.0, lt=1.0, what="a fraction")
    grad_clip: float = bounded(1.0, ge=0)
    seed: int = 0
    eval_every: int = 0
    checkpoint_every: int = 50
    data: TextConfig = field(default_factory=lambda: TextConfig(sequences=1024, length=128))
    heldout: HeldoutConfig = field(default_factory=lambda: HeldoutConfig(sequences=32, length=128))

    def problems(self) -> list[str]:
        """Return value errors (the teacher-dependent check is :func:`check_student`)."""
        out = []
        if self.student_hidden < 1:
            out.append(f"student_hidden: got {self.student_hidden}; expected a positive width below "
                       "the teacher's hidden size (--student-hidden H)")
        out += [f"data.{p}" for p in problems_of(self.data)]
        out += [f"heldout.{p}" for p in problems_of(self.heldout)]
        return out
