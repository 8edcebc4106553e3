"""``rankwise distill CONFIG [--set ...] [--out DIR]``: Low-Rank Clone distillation.

CONFIG holds ``teacher:`` and the :class:`DistillConfig` keys (:func:`read_command`; the old
spelling ``distill TEACHER --student-hidden H --out DIR`` still works). The teacher is a transformers model folder or a finished ``rankwise train`` run (its adapters
merged first, as ``export --format merged`` writes them). The student
(:class:`rankwise.compress.clone.LowRankClone`) trains through the shared engine (its KL and
clone terms are auxiliary losses beside the causal-LM cross-entropy); DIR then holds

* ``model/``: the plain student (``LlamaForCausalLM``, safetensors; transformers loads it
  without rankwise), with the teacher's tokenizer when it has one;
* ``distill.yaml`` (the resolved config), ``events.jsonl``, ``metrics.json``, ``loss.png``,
  ``checkpoints/`` (``--resume`` continues from the newest).

Training text defaults to the standard library's training modules, read with the teacher's
tokenizer, or as UTF-8 bytes (token id = byte) when the teacher folder has no tokenizer, as
``bench lowrank-pretrain``'s byte-level models are trained.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from rankwise.compress.clone import DistillConfig, LowRankClone, check_student
from rankwise.configs import from_dict, to_dict
from rankwise.errors import RankwiseError

CONFIG_FILE = "distill.yaml"


class ByteTokenizer:
    """Text as UTF-8 bytes (token id = byte value, no special tokens): the tokenizer of a model
    folder without one (rankwise's byte-level pretraining benchmarks)."""

    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """``{"input_ids": list(text.encode())}``."""
        return {"input_ids": list(text.encode("utf-8", errors="replace"))}


def read_config(path: Path | None, sets: list[str], student_hidden: int | None) -> DistillConfig:
    """The validated config: defaults, then the YAML file, ``--set`` and ``--student-hidden``.

    Raises:
        RankwiseError: Every bad key or value at once.
    """
    from rankwise.recipes.config import read_yaml
    from rankwise.recipes.paths import DISTILL_PATHS
    return _build(read_yaml(path, DISTILL_PATHS) if path is not None else {}, sets, student_hidden)


def _build(data: dict, sets: list[str], student_hidden: int | None) -> DistillConfig:
    from rankwise.recipes.config import apply_sets
    data = apply_sets(data or {}, list(sets))
    if student_hidden is not None:
        data["student_hidden"] = student_hidden
    wrong = [f"distill.{k}: got {data[k]!r}; expected a mapping such as {{source: {data[k]}, "
             "sequences: 1024, length: 128}" for k in ("data", "heldout") if isinstance(data.get(k), str)]
    if wrong:  # a file name where the windows' section goes
        raise RankwiseError("; ".join(wrong))
    return from_dict(DistillConfig, data, "distill")


def is_config(source: Path) -> bool:
    """Whether ``rankwise distill SOURCE`` names a config file (``CONFIG``, with ``teacher:``)
    rather than the teacher's folder (the old spelling)."""
    return Path(source).suffix in (".yaml", ".yml") and not Path(source).is_dir()


def read_command(source: Path, config: Path | None, sets: list[str], student_hidden: int | None,
                 out: Path | None) -> tuple[Path, DistillConfig, Path]:
    """``(teacher, config, out)`` of ``rankwise distill``, in either spelling.

    ``distill CONFIG [--set ...] [--out DIR]``, as every config command: CONFIG holds
    ``teacher:`` (a model or run folder, read from CONFIG's folder when relative) and the
    :class:`DistillConfig` keys, as the ``distill.yaml`` a run writes does; ``--out`` defaults to
    ``runs/<stem>-distill``. The old spelling, ``distill TEACHER --out DIR [--config FILE]``, is
    read until the next release with a one-line notice.

    Raises:
        RankwiseError: No ``teacher:``, ``--config`` beside a CONFIG, no ``--out`` in the old
            spelling, or the config's problems (all at once).
    """
    from rankwise.commands.options import default_out
    from rankwise.recipes import legacy
    from rankwise.recipes.config import apply_sets, read_yaml
    from rankwise.recipes.paths import DISTILL_PATHS
    source = Path(source)
    if is_config(source):
        if config is not None:
            raise RankwiseError(f"distill {source} reads its keys from that file; drop --config {config} "
                                "(or merge its keys into it)")
        data = apply_sets(read_yaml(source, {**DISTILL_PATHS, ("teacher",): ()}), list(sets))
        teacher = data.pop("teacher", None)
        cfg = _build(data, [], student_hidden)
        if not isinstance(teacher, str) or not teacher.strip():
            raise RankwiseError(f"config {source}: teacher: missing; write teacher: <the model or run "
                                "folder to distill>")
        return Path(teacher), cfg, out or default_out(source, "distill")
    legacy.notice(f"notice: distill TEACHER {'--config FILE ' if config else ''}is the old spelling, read "
                  "until the next release; write teacher: TEACHER in a config and run rankwise distill CONFIG")
    if out is None:
        raise RankwiseError(f"distill {source}: give --out DIR (or write teacher: {source} in a config "
                            "and run rankwise distill CONFIG)")
    return source, read_config(config, sets, student_hidden), out


def load_teacher(path: Path, student_hidden: int) -> tuple[torch.nn.Module, Any]:
    """The teacher model (float32, eval) and its tokenizer (:class:`ByteTokenizer` if none),
    through the shared loader (:func:`rankwise.recipes.teacher.load_teacher`).

    A model folder's config is checked (:func:`check_student`) before its weights are read.

    Raises:
        RankwiseError: A missing folder, a run that is not finished, or a teacher/width that
            Low-Rank Clone cannot map.
    """
    from rankwise.recipes.teacher import load_teacher as load
    model, tok = load(path, what="distill: TEACHER", check=lambda config: check_student(config, student_hidden))
    return model, tok if tok is not None else ByteTokenizer()


def _check_out(out: Path, resume: bool) -> bool:
    """Whether to resume: refuse a non-empty folder that is not a distill run (another
    command's output, the user's own files), and a distill run without ``--resume``."""
    from rankwise.recipes import folders
    from rankwise.recipes.checkpoint import list_checkpoints
    if folders.check_kind(out, "distill", "distill writes only into a new or empty folder or "
                          "continues its own run (--resume): choose another --out") is None:
        return False
    if not resume:
        raise RankwiseError(f"--out {out} already holds a distill run; pass --resume to continue it "
                            "or choose another --out")
    return bool(list_checkpoints(out))


def run_distill(teacher_path: Path, out: Path, cfg: DistillConfig, resume: bool = False,
                console: Any = None) -> dict:
    """Distill, bake and write DIR (module docstring).

    Returns:
        The ``metrics.json`` dict (held-out loss and perplexity of teacher and student,
        parameter counts, tokens seen).

    Raises:
        RankwiseError: Bad teacher, width, data or output folder.
    """
    from rankwise.engine import Engine, evaluate, get_task, linear_schedule
    from rankwise.engine.callbacks import Checkpoint, Evaluate, EventLog, LossPlot, ProgressBar
    from rankwise.recipes.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
    from rankwise.recipes.compress import Windows, token_windows
    from rankwise.core import atomic
    from rankwise.recipes import folders
    out = atomic.check_folder(out)
    resuming = _check_out(out, resume)
    teacher, tok = load_teacher(teacher_path, cfg.student_hidden)
    pad = getattr(tok, "pad_token_id", None) or 0
    train = Windows(token_windows(cfg.data, tok, "data"), pad)
    heldout = Windows(token_windows(cfg.heldout, tok, "heldout"), pad)
    task = get_task("causal-lm")
    model = LowRankClone(teacher, cfg.student_hidden, cfg.temperature, cfg.kl_weight, cfg.clone_weight,
                         cfg.tie_head_projection, cfg.kl_reduction, cfg.init, cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    out.mkdir(parents=True, exist_ok=True)
    folders.record(out, "distill")
    (out / CONFIG_FILE).write_text(yaml.safe_dump({"teacher": str(teacher_path), **to_dict(cfg)}, sort_keys=False))
    log = EventLog(out / "events.jsonl")
    began = time.perf_counter()

    def save(engine, state):
        save_checkpoint(out, state.step, engine.model, engine.state_dict(),
                        meta={"train_time_s": time.perf_counter() - began})
    engine = Engine(model, task, opt, train, cfg.batch, seed=cfg.seed,
                    scheduler=linear_schedule(opt, cfg.steps, cfg.warmup_fraction),
                    grad_clip=cfg.grad_clip or None,
                    callbacks=[log, Evaluate(heldout, 16, cfg.eval_every, log, at_end=False),
                               Checkpoint(save, cfg.checkpoint_every), ProgressBar("distill", console, tokens=True),
                               LossPlot(log, out / "loss.png", "Low-Rank Clone")])
    start = 0
    if resuming:
        start = int(load_checkpoint(list_checkpoints(out)[-1], model, engine)["step"])
    engine.fit(cfg.steps, start_step=start)
    student = model.bake()
    student.save_pretrained(out / "model")
    if not isinstance(tok, ByteTokenizer):
        tok.save_pretrained(out / "model")
    t_eval = evaluate(teacher, task, heldout, 16)
    s_eval = evaluate(student, task, heldout, 16)
    metrics = {"teacher_eval_loss": t_eval["eval_loss"], "teacher_eval_perplexity": t_eval["eval_perplexity"],
               "student_eval_loss": s_eval["eval_loss"], "student_eval_perplexity": s_eval["eval_perplexity"],
               "teacher_params": sum(p.numel() for p in teacher.parameters()),
               "student_params": sum(p.numel() for p in student.parameters()),
               "trainable_params": sum(p.numel() for p in params),
               "steps": cfg.steps, "tokens_seen": cfg.steps * cfg.batch * cfg.data.length,
               "student_hidden": cfg.student_hidden, "teacher_hidden": teacher.config.hidden_size}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics
