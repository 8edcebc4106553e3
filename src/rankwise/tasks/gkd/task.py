"""The ``gkd`` task: on-policy distillation (Generalized Knowledge Distillation).

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes", Algorithm 1, as TRL 1.16's ``GKDTrainer`` (``trl.experimental.gkd``) runs it. The
records are prompt + completion examples (``data.format: prompt-completion``, ``chat`` or a
preset). Each micro-batch of a training step draws ``u ~ U[0, 1)``:

* ``u < lmbda``: the student samples a completion of every prompt (on-policy; the one decode
  loop, :func:`rankwise.engine.generation.sample_groups`, at ``temperature`` / ``top_p``, up to
  ``max_new_tokens``, its first EOS kept);
* else, with ``seq_kd``, the teacher samples them (sequence-level KD);
* else the data's own completions are used (supervised KD).

The frozen teacher (``task.teacher``: a model folder or a finished run folder, its adapters
merged) and the student then read the same prompt + completion tokens, and the loss is the
generalized JSD of :mod:`rankwise.tasks.gkd.loss` between their next-token distributions at
every completion token (the prompt carries none), summed and divided by the step's completion
tokens over every micro-batch and process (TRL's ``num_items_in_batch``).

Where rankwise and TRL differ, and why:

* ``temperature`` samples; the divergence is taken at ``T = 1`` as ``GKDTrainer.compute_loss``
  does (it does not pass the temperature to ``generalized_jsd_loss``). ``temperature_in_loss:
  true`` divides both logits by it too, as TRL's ``DistillationTrainer`` does (which is this
  task with ``lmbda: 1``).
* TRL's ``GKDTrainer`` normalises by the token count of the *data's* completions (transformers
  counts the labels before on-policy generation replaces them); we divide by the tokens the loss
  sums, as ``DistillationTrainer`` does.
* The on-policy draw and the samples are seeded by ``train.seed``, the step and the
  micro-batch's place in it (as GRPO's groups are), so a resumed run draws the same.

Evaluation scores the data's completions (off-policy, nothing sampled; ``GKDTrainer``'s
evaluation too): ``eval_loss`` is the mean divergence per completion token.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from rankwise.configs import bounded
from rankwise.data.formats import end_id
from rankwise.engine.generation import sample_groups
from rankwise.engine.task import IGNORE, Task, TaskConfig, pad
from rankwise.errors import RankwiseError
from rankwise.tasks.common import lm_example, write_records
from rankwise.tasks.gkd.loss import generalized_jsd
from rankwise.tasks.reference import disable_dropout

TINY_TEACHERS = ("tiny-gpt2", "tiny-llama")  # in-code test models (the task's example)


@dataclass
class GKDConfig(TaskConfig):
    """The ``task:`` section of ``task: {name: gkd, teacher: ...}`` (TRL's ``GKDConfig`` names).

    Attributes:
        name: ``gkd``.
        teacher: The frozen teacher: a transformers causal-LM folder or a finished ``rankwise
            train`` run folder (its adapters merged); it must share the student's tokenizer.
        teacher_dtype: The teacher's weights: ``float32``, ``bfloat16`` or ``float16``.
        lmbda: ``lambda``, the share of micro-batches whose completions the student samples
            (on-policy); 0: never, 1: always (TRL's ``DistillationTrainer``).
        beta: The divergence (:mod:`rankwise.tasks.gkd.loss`): 0 forward KL, 1 reverse KL,
            between them the generalized JSD.
        temperature: Sampling temperature (> 0) of the student's (and ``seq_kd``'s teacher's)
            completions.
        temperature_in_loss: Divide both logits by ``temperature`` in the divergence too
            (``DistillationTrainer``); ``false``: the divergence at 1 (``GKDTrainer``).
        top_p: Nucleus mass when sampling (1: the whole distribution, TRL's GKD).
        max_new_tokens: Tokens per sampled completion, at most.
        seq_kd: Micro-batches that are not on-policy take the teacher's sampled completions
            instead of the data's (sequence-level KD).
        disable_dropout: Set every dropout of the student to ``p = 0`` before training
            (TRL's ``GKDConfig`` default); the teacher runs in eval mode.
    """

    paths: ClassVar[tuple[str, ...]] = ("teacher",)

    name: str = "gkd"
    teacher: str = ""
    teacher_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lmbda: float = bounded(0.5, ge=0, le=1)
    beta: float = bounded(0.5, ge=0, le=1)
    temperature: float = bounded(0.9, gt=0, hint="(GKD samples completions at it)")
    temperature_in_loss: bool = False
    top_p: float = bounded(1.0, gt=0, le=1)
    max_new_tokens: int = bounded(128, ge=1, what="tokens")
    seq_kd: bool = False
    disable_dropout: bool = True

    def problems(self) -> list[str]:
        """Return value errors (the ranges are declared on the fields)."""
        if not self.teacher:
            return ["teacher: empty; set task.teacher to the teacher's model or run folder"]
        return []

    def run_problems(self, run: Any) -> list[str]:
        """The teacher must exist; the records need prompts (a prompt-completion or chat
        format), and every example is one prompt + completion, so packing, prompt targets,
        question-free training, long-text windows and a length schedule are refused."""
        out = []
        if self.teacher and self.teacher not in TINY_TEACHERS and not Path(self.teacher).expanduser().exists():
            out.append(f"task.teacher {self.teacher} not found; set it to a transformers model "
                       "folder (config.json) or a finished rankwise run folder (config.yaml)")
        d = run.data
        if d.format == "text":
            out.append("data.format: text has no prompts for the student to continue; task.name: "
                       "gkd needs prompt-completion or chat records: set data.format")
        flags = [("data.packing", d.packing), ("data.train_on_prompt", d.train_on_prompt),
                 ("data.question_free", d.question_free), ("data.split_long", d.split_long),
                 ("data.schedule", d.schedule.name != "none")]
        for what, on in flags:
            if on:
                out.append(f"{what} is not supported with task.name: gkd (each example is one "
                           "prompt and its completion); remove it")
        return out


class GKDTask(Task):
    """Prompt + completion examples; targets: completion tokens (see the module docstring).

    Args:
        config: The ``task:`` section (default: :class:`GKDConfig`).
    """

    name = "gkd"
    auto_class = "AutoModelForCausalLM"

    def __init__(self, config: GKDConfig | None = None) -> None:
        super().__init__(config or GKDConfig())
        self.teacher: nn.Module | None = None     # loaded on first use (or set by a caller)
        self.tokenizer: Any = None                # the student's (records() is handed it)
        self._sums: dict[str, float] = {}

    @classmethod
    def example(cls, folder):
        """``tiny-llama`` distilled from ``tiny-gpt2`` (the same tokenizer) on 12 prompts."""
        records = [{"prompt": f"def f{i}(x):\n", "completion": f"    return x + {i}"} for i in range(12)]
        return lm_example(folder, {"name": cls.name, "teacher": "tiny-gpt2", "lmbda": 0.5, "beta": 0.5,
                                   "max_new_tokens": 4},
                          data={"source": write_records(Path(folder) / "prompts.jsonl", records),
                                "format": "prompt-completion", "max_length": 24, "eval_fraction": 0.25})

    def records(self, data_cfg, tokenizer, progress=False):
        """Keep the student's tokenizer (EOS, the teacher's vocabulary check); the records are
        encoded as the causal LM's (``None``: :func:`rankwise.data.text.build_data`)."""
        self.tokenizer = tokenizer
        return None

    def collate(self, items, pad_id):
        """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (``-100`` but on the
        completion: a chat record's last assistant turn, as TRL's ``DataCollatorForChatML``
        takes it; earlier turns are prompt), and ``pad_id``."""
        ids, mask = pad([it["input_ids"] for it in items], pad_id)             # (B, T)
        cuts = [completion_start(it["labels"]) for it in items]
        labels, _ = pad([[IGNORE] * k + list(it["labels"][k:]) for it, k in zip(items, cuts)], IGNORE)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "pad_id": torch.tensor(pad_id)}

    def count_targets(self, batch):
        """The completion tokens the loss sums (each predicted from the token before it)."""
        return int((batch["labels"][:, 1:] != IGNORE).sum())

    # ----- the teacher ---------------------------------------------------------------------------
    def teacher_for(self, model: nn.Module, device: Any) -> nn.Module:
        """The teacher on ``device``, loaded on the first call (the run's :attr:`teacher_loader`,
        else transformers) and checked against the student's vocabulary.

        Raises:
            RankwiseError: A teacher with another vocabulary or tokenizer than the student's.
        """
        if self.teacher is None:
            c = self.config
            load = self.teacher_loader or _load_folder
            teacher, tok = load(c.teacher, str(device), c.teacher_dtype)
            problem = vocabulary_problem(_unwrap(model), self.tokenizer, teacher, tok, c.teacher)
            if problem:
                raise RankwiseError(problem)
            for p in teacher.parameters():
                p.requires_grad_(False)
            self.teacher = teacher.eval()
        return self.teacher

    def prepare(self, model, datasets, trains_full, batch_size, device):
        """Switch the student's dropout off (``task.disable_dropout``) and load the teacher."""
        if self.config.disable_dropout:
            disable_dropout(model)
        self.teacher_for(model, device)
        return None

    # ----- sampling -------------------------------------------------------------------------------
    def before_step(self, model: nn.Module, batches: list[dict], step: int, seed: int) -> list[dict]:
        """Draw each micro-batch's source (student, teacher or the data) and sample its
        completions. Each micro-batch draws from its own seed: ``seed``, ``step`` and its place
        among the step's micro-batches over all processes (process ``r``'s ``i``-th of ``k``:
        ``r k + i``), so a resumed run draws and samples the same."""
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and \
            torch.distributed.is_initialized() else 0
        c, out = self.config, []
        for i, b in enumerate(batches):
            devices = [b["input_ids"].device] if b["input_ids"].device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed((seed * 1_000_003 + step) * 1_009 + rank * len(batches) + i)
                on_policy = float(torch.rand(())) < c.lmbda
                if on_policy or c.seq_kd:
                    who = _unwrap(model) if on_policy else self.teacher_for(model, b["input_ids"].device)
                    b = self.sample(who, b)
            self._add("student_batches" if on_policy else "teacher_batches" if c.seq_kd else "data_batches", 1)
            out.append(b)
        return out

    def sample(self, generator: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch``'s prompts with completions sampled from ``generator`` (no gradient).

        Returns:
            Right-padded prompt + completion rows (``labels`` on the completion, EOS included).
        """
        c, device = self.config, batch["input_ids"].device
        pad_id = int(batch["pad_id"])
        eos = end_id(self.tokenizer) if self.tokenizer is not None else pad_id
        prompts = prompts_of(batch)
        completions = sample_groups(generator, prompts, 1, c.max_new_tokens, eos, pad_id, c.temperature,
                                    c.top_p, str(device))
        self._add("completion_tokens", sum(len(x) for x in completions))
        self._add("completions", len(completions))
        items = [{"input_ids": p + x, "labels": [IGNORE] * len(p) + x} for p, x in zip(prompts, completions)]
        return {k: v.to(device) for k, v in self.collate(items, pad_id).items()}

    # ----- loss -----------------------------------------------------------------------------------
    def loss_sum(self, model, batch):
        """The summed divergence over the completion tokens of ``batch`` (the teacher's logits
        without gradient); its sum over the step divided by the step's :meth:`count_targets` is
        TRL's loss. Evaluation scores the data's completions the same way."""
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        out, seen = self._forward(model, inputs)
        teacher = self.teacher_for(model, batch["input_ids"].device)
        with torch.no_grad():
            t_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        s_keep = seen["labels"][:, 1:] != IGNORE                       # the student's (input adapters)
        t_keep = batch["labels"][:, 1:] != IGNORE
        student = out.logits[:, :-1][s_keep]                            # (N, V): completion positions
        c = self.config
        per_token = generalized_jsd(student, t_logits[:, :-1][t_keep], c.beta,
                                    c.temperature if c.temperature_in_loss else 1.0)
        return per_token.sum(), per_token.detach()

    def step_metrics(self) -> dict[str, float]:
        """The step's shares of micro-batches by completion source (``on_policy``: the
        student's, ``teacher_sampled``: ``seq_kd``'s) and the sampled completions' mean length."""
        s, self._sums = self._sums, {}
        n = s.get("student_batches", 0.0) + s.get("teacher_batches", 0.0) + s.get("data_batches", 0.0)
        if not n:
            return {}
        out = {"on_policy": s.get("student_batches", 0.0) / n}
        if self.config.seq_kd:
            out["teacher_sampled"] = s.get("teacher_batches", 0.0) / n
        if s.get("completions"):
            out["completion_length"] = s["completion_tokens"] / s["completions"]
        return out

    def eval_metrics(self, stats):
        """``eval_loss``: the mean divergence per completion token of the data's completions."""
        return {"eval_loss": stats.get("loss", 0.0) / max(stats.get("targets", 0.0), 1.0)}

    def _add(self, key: str, value: float) -> None:
        self._sums[key] = self._sums.get(key, 0.0) + float(value)


def completion_start(labels: list[int]) -> int:
    """Where the completion of an example starts: its last run of targets (a chat record's last
    assistant turn), as :func:`rankwise.data.formats.split_example` cuts it."""
    cut = len(labels)
    while cut > 0 and labels[cut - 1] == IGNORE:
        cut -= 1
    while cut > 0 and labels[cut - 1] != IGNORE:
        cut -= 1
    return cut


def prompts_of(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """Each row's prompt: its tokens before its completion (:func:`completion_start`)."""
    return [ids[:completion_start(labels[:int(n)])] for ids, labels, n in
            zip(batch["input_ids"].tolist(), batch["labels"].tolist(), batch["attention_mask"].sum(-1).tolist())]


def vocabulary_problem(student: nn.Module, student_tok: Any, teacher: nn.Module, teacher_tok: Any,
                       path: str) -> str | None:
    """Why ``teacher`` cannot teach ``student`` (one line naming the fix), or ``None``: the
    divergence compares next-token distributions over one vocabulary, so the logits must be as
    wide (TRL's check) and, where both tokenizers are known, map the same tokens to the same ids."""
    fix = ("generalized JSD compares next-token distributions over one vocabulary: choose a teacher "
           "that shares the student's tokenizer (the same model family)")
    sv, tv = _vocab_size(student), _vocab_size(teacher)
    if sv != tv:
        return f"task.teacher {path} has a vocabulary of {tv} tokens and the student {sv}; {fix}"
    if student_tok is not None and teacher_tok is not None:
        mine, theirs = student_tok.get_vocab(), teacher_tok.get_vocab()
        if mine != theirs:
            other = sum(theirs.get(t) != i for t, i in mine.items())
            return (f"task.teacher {path} has another tokenizer ({other} of the student's {len(mine)} "
                    f"tokens have another id or none); {fix}")
    return None


def _vocab_size(model: nn.Module) -> int:
    config = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(config.vocab_size)


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP: generate on (and read the config of) the wrapped model


def _load_folder(path: str, device: str, dtype: str) -> tuple[nn.Module, Any]:
    """Outside a run (no :attr:`Task.teacher_loader`): a transformers model folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not (Path(path).expanduser() / "config.json").is_file():
        raise RankwiseError(f"task.teacher {path} is not a model folder (no config.json); set it to "
                            "the teacher's folder")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        tok = None
    return model.to(device).eval(), tok


__all__ = ["GKDConfig", "GKDTask", "TINY_TEACHERS", "completion_start", "prompts_of", "vocabulary_problem"]
