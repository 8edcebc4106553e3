"""The ``kto`` task: Kahneman-Tversky Optimization on unpaired ``{prompt, completion, label}`` examples.

Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 8:
``L = E[lambda_y - v(x, y)]`` with the implicit reward ``r(x, y) = log pi(y|x) - log pi_ref(y|x)``
(summed over the completion tokens, as in ``dpo``) and the reference point ``z``:

* desirable ``y``: ``lambda_D * (1 - sigma(beta (r - z)))``;
* undesirable ``y``: ``lambda_U * (1 - sigma(beta (z - r)))``;

``lambda_D`` / ``lambda_U`` are ``task.desirable_weight`` / ``task.undesirable_weight`` and the
loss is the mean over the examples (the step's, under accumulation and torchrun, like every task).

The reference point is the paper's ``z_0 = KL(pi(y'|x) || pi_ref(y'|x))``, estimated as TRL
1.16's ``KTOTrainer`` does: every prompt of the batch with *another* example's completion,
``z = max(0, mean_i [log pi(y_{i-1}|x_i) - log pi_ref(y_{i-1}|x_i)])`` (``i - 1`` cyclic in the
batch: the completions rotated by one), with no gradient (the policy's mismatched forward runs
under ``torch.no_grad``), and under torchrun the per-process means averaged over the processes
before the clamp at 0 (TRL's ``gather_for_metrics(kl).mean().clamp(min=0)``).

Where TRL differs from the paper, and where rankwise differs from TRL:

* the paper pairs inputs with "unrelated outputs" in a batch; TRL fixes the rotation when it
  tokenizes the dataset, in chunks of ``per_device_train_batch_size`` in file order, and forbids
  shuffling so the chunks are the batches. rankwise rotates within each micro-batch as it is
  collated: on a given batch the same numbers as TRL (the parity test), the same set of
  completions as the batch's (TRL's aim), while the batches stay shuffled (the pairing changes
  every epoch);
* with ``reference: precomputed`` the pairing cannot depend on the batch (its reference log-probs
  are computed before training): each example gets a fixed mismatched completion instead
  (:meth:`~rankwise.tasks.kto.data.UnpairedData.fix_partners`), as TRL's pairing is fixed;
* evaluation uses the fixed pairing too and one ``z`` over the whole evaluation set (TRL: one per
  evaluation batch), so the metrics do not depend on ``train.eval_batch_size``.

The reference ``pi_ref`` is ``dpo``'s (:mod:`rankwise.tasks.reference`): the adapters switched
off, the initial weights swapped in (``initial``), or log-probs precomputed before training.
Every log-prob (policy, reference, mismatched rows) goes through
:func:`rankwise.tasks.logprobs.target_logps`: with ``train.loss_chunk_tokens`` the completion
positions are projected in checkpointed chunks and the ``(B, T, V)`` logits are never formed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from rankwise.engine.distributed import world_size_from_env
from rankwise.engine.task import IGNORE, Task, TaskConfig, pad
from rankwise.tasks.common import CausalLMTask, lm_example, write_records
from rankwise.tasks.kto.data import balance_warning, build_unpaired_data
from rankwise.tasks.logprobs import target_logps
from rankwise.tasks.pair_task import pair_run_problems
from rankwise.tasks.pairs import cut_prompt
from rankwise.tasks.reference import WeightSnapshot, precompute_logps, prepare_reference, reference, reference_problems

ACROSS = "kto_kl_across_processes"  # a batch key set by before_step: this micro-batch is a step's


@dataclass
class KTOConfig(TaskConfig):
    """The ``task:`` section of ``task: {name: kto}`` (defaults: TRL 1.16's ``KTOConfig``).

    Attributes:
        name: ``kto``.
        beta: ``beta`` of eq. 8 (the KL strength).
        desirable_weight: ``lambda_D``, the weight of a desirable example's loss.
        undesirable_weight: ``lambda_U``, the weight of an undesirable example's loss. The paper
            recommends ``lambda_D n_D / (lambda_U n_U)`` in ``[1, 4/3]`` (``n``: examples of each
            kind); the data warns when neither weight is in that range.
        reference: ``dpo``'s: ``adapters-off``, ``precomputed``, ``initial`` or ``auto``.
        disable_dropout: Every dropout ``p = 0`` before training (TRL's default), so the policy
            and reference forwards are one function.
    """

    name: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    reference: Literal["auto", "adapters-off", "precomputed", "initial"] = "auto"
    disable_dropout: bool = True

    def problems(self) -> list[str]:
        """Return value errors."""
        out = [] if self.beta > 0 else [f"beta: got {self.beta}; expected a value > 0"]
        for key in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, key) > 0:
                out.append(f"{key}: got {getattr(self, key)}; expected a value > 0")
        return out

    def run_problems(self, run: Any) -> list[str]:
        """The reference must exist; examples are scored whole, on their completions (no
        packing, samples, prompt targets or length schedule); and each micro-batch needs two
        examples, or the mismatched pair of the KL estimate is the example itself (TRL refuses
        a per-device batch of 1 for the same reason)."""
        out = reference_problems(self.reference, run) + pair_run_problems(
            self.name, run, scored="examples are scored whole, on their completions",
            schedule="data.schedule: skrull regroups the examples of a step, and task.name: kto "
                     "estimates its KL term within each micro-batch; set data.schedule: none")
        parts = max(1, run.train.grad_accum) * world_size_from_env()
        if run.train.batch_size // parts < 2:
            out.append(f"train.batch_size {run.train.batch_size} over {parts} micro-batch(es) leaves "
                       "fewer than 2 examples in one, and KTO's KL estimate pairs each prompt with "
                       f"another example's completion: set train.batch_size >= {2 * parts}")
        return out


def kl_reference_point(policy_kl: torch.Tensor, reference_kl: torch.Tensor, across: bool = False
                       ) -> torch.Tensor:
    """TRL's estimate of ``z_0``: the mean log-ratio of the mismatched rows, detached, averaged
    over the processes (``across``, under torchrun), clamped at 0.

    Args:
        policy_kl: ``(B,)`` log-probs of the mismatched completions under the policy.
        reference_kl: ``(B,)`` the same under the reference.
        across: Average the per-process means over every process (a training step's
            micro-batch; every process calls it the same number of times).

    Returns:
        The scalar ``z``.
    """
    kl = (policy_kl - reference_kl).mean().detach()
    if across and torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        comm = kl.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
        t = kl.float().reshape(1).to(comm)
        torch.distributed.all_reduce(t)
        kl = (t / torch.distributed.get_world_size()).reshape(()).to(kl.device)
    return kl.clamp(min=0)


def kto_losses(policy: torch.Tensor, reference: torch.Tensor, z: torch.Tensor, desirable: torch.Tensor,
               beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example KTO losses (eq. 8) and implicit rewards.

    Args:
        policy: ``(B,)`` completion log-probs of the trained model.
        reference: ``(B,)`` the same under the reference.
        z: The reference point (scalar, no gradient).
        desirable: ``(B,)`` bool labels.
        beta: ``beta``.
        desirable_weight: ``lambda_D``.
        undesirable_weight: ``lambda_U``.

    Returns:
        ``(losses (B,), rewards (B,))`` with ``rewards = beta * (policy - reference)`` (detached).
    """
    ratio = policy - reference                                      # (B,) r(x, y)
    good = desirable_weight * (1 - torch.sigmoid(beta * (ratio - z)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z - ratio)))
    return torch.where(desirable, good, bad), beta * ratio.detach()


@dataclass
class KTOOutput:
    """What one KTO forward measured (per example, detached)."""

    logps: torch.Tensor       # (B,) policy completion log-probs
    ratios: torch.Tensor      # (B,) r = policy - reference
    kl_ratios: torch.Tensor   # (B,) mismatched rows' policy - reference
    desirable: torch.Tensor   # (B,) bool
    z: float                  # the reference point used


class KTOTask(Task):
    """Unpaired examples ``{prompt, completion, label}``: one target per example.

    Examples are ``{"prompt_ids", "completion_ids", "label", "keep", "max_length"}`` (and
    ``"kl_completion_ids"`` once their mismatched partner is fixed, ``"ref_logps"`` ``[completion,
    mismatched]`` with a precomputed reference; :mod:`rankwise.tasks.kto.data` builds them).

    Args:
        config: The ``task:`` section (default: :class:`KTOConfig`).
    """

    name = "kto"
    auto_class = "AutoModelForCausalLM"
    eval_logits_bytes: int = CausalLMTask.eval_logits_bytes
    # Completion positions per chunk of the log-probs (:mod:`rankwise.tasks.logprobs`); 0 = the
    # whole logits at once. ``rankwise train`` sets it from ``train.loss_chunk_tokens``.
    loss_chunk_tokens: int = 0

    def __init__(self, config: KTOConfig | None = None) -> None:
        super().__init__(config or KTOConfig())
        self._sums: dict[str, float] = {}
        self.snapshot: WeightSnapshot | None = None  # the ``initial`` reference's weights

    @classmethod
    def example(cls, folder):
        """``tiny-llama`` preferring a function's body to ``pass`` (16 unpaired examples)."""
        recs = [{"prompt": f"def f{i}(x):\n", "completion": f"    return x + {i}" if i % 2 else "    pass",
                 "label": bool(i % 2)} for i in range(16)]
        return lm_example(folder, {"name": cls.name, "beta": 0.2},
                          data={"source": write_records(Path(folder) / "unpaired.jsonl", recs),
                                "max_length": 24, "eval_fraction": 0.25})

    def records(self, data_cfg, tokenizer, progress=False):
        """The ``data:`` section's unpaired examples (:func:`~rankwise.tasks.kto.data.build_unpaired_data`);
        warns when the weights are outside the paper's recommended range for the label balance."""
        train, evals = build_unpaired_data(data_cfg, tokenizer, progress)
        c = self.config
        balance_warning(train.desirable, len(train) - train.desirable, c.desirable_weight, c.undesirable_weight)
        return train, evals

    def collate(self, items, pad_id):
        """Rows ``i`` are ``prompt_i + completion_i``; the mismatched rows ``kl_*`` are
        ``prompt_i + completion_{i-1}`` (cyclic), or each example's fixed partner's completion
        when it has one, the prompt cut from the left to fit ``max_length``."""
        comps = [it["completion_ids"] for it in items]
        if all("kl_completion_ids" in it for it in items):
            others = [it["kl_completion_ids"] for it in items]
        else:
            others = comps[-1:] + comps[:-1]                        # TRL's rotation by one
        batch = {}
        for prefix, tails in (("", comps), ("kl_", others)):
            heads = [cut_prompt(it["prompt_ids"], len(t), it["keep"], it["max_length"]) or []
                     for it, t in zip(items, tails)]
            ids, mask = pad([h + t for h, t in zip(heads, tails)], pad_id)       # (B, T)
            labels, _ = pad([[IGNORE] * len(h) + t for h, t in zip(heads, tails)], IGNORE)
            batch.update({f"{prefix}input_ids": ids, f"{prefix}attention_mask": mask, f"{prefix}labels": labels})
        batch["desirable"] = torch.tensor([bool(it["label"]) for it in items])
        if all("ref_logps" in it for it in items):
            batch["ref_logps"] = torch.tensor([list(it["ref_logps"]) for it in items], dtype=torch.float32)
        return batch

    def count_targets(self, batch):
        """One target per example."""
        return int(batch["input_ids"].shape[0])

    def sequence_logps(self, model: nn.Module, batch: dict[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
        """``(B,)`` completion log-probs of ``model`` on the rows ``prefix`` (``""``: each
        example's own completion, ``"kl_"``: the mismatched one), in chunks of
        ``loss_chunk_tokens`` completion positions when set (the full logits are never formed)."""
        inputs = {k: batch[prefix + k] for k in ("input_ids", "attention_mask", "labels")}
        return target_logps(model, lambda: self._forward(model, inputs), self.loss_chunk_tokens).sums()

    def reference_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(B, 2)`` reference log-probs ``[completion, mismatched]``: the batch's precomputed
        ones, or the model with its adapters off or its initial weights in (no gradient)."""
        if "ref_logps" in batch:
            return batch["ref_logps"]
        with torch.no_grad(), reference(model, self.snapshot):
            return torch.stack([self.sequence_logps(model, batch), self.sequence_logps(model, batch, "kl_")], -1)

    def loss_sum(self, model, batch):
        """Summed per-example loss (eq. 8) with the batch's reference point ``z``."""
        c = self.config
        with torch.no_grad():
            policy_kl = self.sequence_logps(model, batch, "kl_")  # detached, as TRL's
        policy = self.sequence_logps(model, batch)
        ref = self.reference_logps(model, batch).to(policy.device)
        z = kl_reference_point(policy_kl, ref[:, 1], across=bool(batch.get(ACROSS)) and model.training)
        desirable = batch["desirable"].to(policy.device)
        losses, _ = kto_losses(policy, ref[:, 0], z, desirable, c.beta, c.desirable_weight, c.undesirable_weight)
        output = KTOOutput(policy.detach(), (policy - ref[:, 0]).detach(), policy_kl - ref[:, 1], desirable, float(z))
        if model.training:
            _add(self._sums, output)
        return losses.sum(), output

    def before_step(self, model, batches, step, seed):
        """Mark the step's micro-batches: under torchrun their KL estimate is averaged over the
        processes (every process runs the same number of them, in step)."""
        return [dict(b, **{ACROSS: True}) for b in batches]

    def eval_parts(self, model, batch):
        """Row slices whose float32 logits fit in ``eval_logits_bytes`` (the evaluation's pairing
        is fixed per example, so slicing changes no metric)."""
        width = max(batch["input_ids"].shape[1], batch["kl_input_ids"].shape[1])
        rows = CausalLMTask.eval_rows(model, width, self.eval_logits_bytes)
        n = self.count_targets(batch)
        if rows is None or rows >= n:
            return [batch]
        return [{k: v[i:i + rows] for k, v in batch.items()} for i in range(0, n, rows)]

    def step_metrics(self) -> dict[str, float]:
        """Means over the training forwards since the last call (this process's): ``kl`` (the
        reference point), rewards and log-probs of each kind."""
        sums, self._sums = self._sums, {}
        out = {"kl": sums["z"] / sums["batches"]} if sums.get("batches") else {}
        return {**out, **_means(sums, "", self.config.beta)}

    def eval_update(self, stats, batch, output, loss_sum):
        """Keep each example's log-ratios (the loss needs the evaluation set's ``z`` first)."""
        for key, value in (("ratios", output.ratios), ("kl_ratios", output.kl_ratios),
                           ("logps", output.logps), ("desirable", output.desirable)):
            stats.setdefault(key, []).extend(value.float().tolist())

    def eval_metrics(self, stats):
        """``eval_loss`` (eq. 8, mean per example) with ``eval_kl``, one ``z`` over every
        evaluation example's mismatched row; the mean rewards and log-probs of each kind."""
        c = self.config
        if not stats.get("ratios"):
            return {"eval_loss": 0.0}
        kl = torch.tensor(stats["kl_ratios"], dtype=torch.float64)
        z = kl.mean().clamp(min=0)
        ratios = torch.tensor(stats["ratios"], dtype=torch.float64)
        desirable = torch.tensor(stats["desirable"]) > 0.5
        losses, _ = kto_losses(ratios, torch.zeros_like(ratios), z, desirable, c.beta,
                               c.desirable_weight, c.undesirable_weight)
        sums: dict[str, float] = {}
        _add(sums, KTOOutput(torch.tensor(stats["logps"]), ratios, kl, desirable, float(z)))
        return {"eval_loss": float(losses.mean()), "eval_kl": float(z), **_means(sums, "eval_", c.beta)}

    def prepare(self, model: nn.Module, datasets: list, trains_full: bool, batch_size: int,
                device: str) -> str:
        """Switch dropout off (``task.disable_dropout``) and resolve ``task.reference``: for
        ``precomputed``, fix every example's mismatched partner and store the reference
        log-probs of the model as it is now (before the first step) with each dataset; for
        ``initial``, copy its trainable tensors.

        Returns:
            The reference in force (``adapters-off``, ``precomputed`` or ``initial``).

        Raises:
            RankwiseError: ``initial`` for an adapter trained from scratch.
        """
        def precompute(data: Any) -> list:
            if not all("kl_completion_ids" in e for e in data.examples):
                data.fix_partners()
            return precompute_reference(self, model, data, batch_size, device)
        return prepare_reference(self, model, datasets, trains_full, precompute)


def precompute_reference(task: KTOTask, model: nn.Module, data: Any, batch_size: int, device: str) -> list:
    """``[[completion, mismatched], ...]`` log-probs of ``model`` over every example of ``data``
    (its partners fixed; in eval mode, so dropout does not enter the reference;
    :func:`rankwise.tasks.reference.precompute_logps`)."""
    return precompute_logps(task, model, data, batch_size, device, lambda batch: torch.stack(
        [task.sequence_logps(model, batch), task.sequence_logps(model, batch, "kl_")], -1))


def _add(stats: dict[str, float], output: KTOOutput) -> None:
    d = output.desirable.bool()
    r, lp = output.ratios.double(), output.logps.double()
    for key, value in (("batches", 1), ("z", output.z), ("n_desirable", d.sum()), ("n_undesirable", (~d).sum()),
                       ("ratio_desirable", r[d].sum()), ("ratio_undesirable", r[~d].sum()),
                       ("logps_desirable", lp[d].sum()), ("logps_undesirable", lp[~d].sum())):
        stats[key] = stats.get(key, 0.0) + float(value)


def _means(stats: dict[str, float], prefix: str, beta: float) -> dict[str, float]:
    """Mean reward (``beta r``) and log-prob of each kind, and their margin when both occur."""
    out = {}
    for kind in ("desirable", "undesirable"):
        n = stats.get(f"n_{kind}", 0.0)
        if n:
            out[f"{prefix}reward_{kind}"] = beta * stats[f"ratio_{kind}"] / n
            out[f"{prefix}logps_{kind}"] = stats[f"logps_{kind}"] / n
    if f"{prefix}reward_desirable" in out and f"{prefix}reward_undesirable" in out:
        out[f"{prefix}reward_margin"] = out[f"{prefix}reward_desirable"] - out[f"{prefix}reward_undesirable"]
    return out


__all__ = ["KTOConfig", "KTOTask", "KTOOutput", "kl_reference_point", "kto_losses",
           "precompute_reference"]
