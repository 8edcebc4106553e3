"""``rankwise train``: one run from a config to a run folder.

The run folder holds ``config.yaml`` (fully resolved), ``events.jsonl`` (one line per logged
step), ``metrics.json``, ``adapter/`` (or ``model/`` for full fine-tuning), ``checkpoints/``
and ``loss.png``. :func:`prepare` builds the pieces from a config (model, data, method,
optimizer); the loop itself is :class:`rankwise.engine.Engine`, and everything around it
(logging, evaluation, checkpoints, plot, progress) is one of its callbacks.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from rankwise import registry
from rankwise.core import atomic
from rankwise.core.io import rebuild, save_adapter, structure
from rankwise.core.ops import count_parameters, modules_to_save
from rankwise.data.text import TextData, build_data
from rankwise.engine import Engine, NonFiniteLoss, Task, batch_indices, get_task, linear_schedule
from rankwise.engine import callbacks as cb
from rankwise.errors import RankwiseError
from rankwise.memory import PeakMemory
from rankwise.recipes.checkpoint import list_checkpoints, load_checkpoint, read_meta, save_checkpoint
from rankwise.recipes.config import RunConfig
from rankwise.recipes.model import load_model, load_tokenizer


@dataclass
class Session:
    """Everything a training loop needs, built from a :class:`RunConfig` by :func:`prepare`."""

    cfg: RunConfig
    model: nn.Module
    tokenizer: Any
    task: Task
    train_data: TextData
    eval_data: TextData
    method_result: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    device: str

    def batch(self, step: int, seed_offset: int = 0) -> dict[str, torch.Tensor]:
        """The collated training batch of ``step`` on the session's device."""
        t = self.cfg.train
        n = len(self.train_data)
        idx = batch_indices(step, n, min(t.batch_size, n), t.seed + seed_offset)
        items = [self.train_data[i] for i in idx]
        return {k: v.to(self.device) for k, v in self.task.collate(items, self.train_data.pad_id).items()}

    def engine(self, callbacks: list | None = None) -> Engine:
        """The :class:`~rankwise.engine.Engine` configured by ``cfg.train``."""
        t = self.cfg.train
        return Engine(self.model, self.task, self.optimizer, self.train_data, t.batch_size,
                      seed=t.seed, scheduler=self.scheduler, grad_clip=t.grad_clip,
                      device=self.device, callbacks=callbacks or [])

    def evaluate(self) -> dict[str, float]:
        """The task's metrics on the evaluation split."""
        return self.engine().evaluate(self.eval_data, self.cfg.train.eval_batch_size)


def pick_device() -> str:
    """``cuda`` when available, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare(cfg: RunConfig, device: str | None = None, model=None, tokenizer=None,
            saved: dict | None = None) -> Session:
    """Load model and data, apply the method, build optimizer and schedule.

    Args:
        cfg: A validated run config.
        device: ``cpu``/``cuda`` (default: CUDA when available).
        model: An already loaded base model (skips loading; the demo reuses one).
        tokenizer: Its tokenizer.
        saved: The adapter structure a checkpoint recorded (``{"layers", "modules_to_save"}``):
            the method's layers are rebuilt from it instead of being initialised again (a
            resumed GoRA run keeps its ranks; no calibration is repeated).

    Returns:
        A ready :class:`Session`.

    Raises:
        RankwiseError: On any problem with the model, data, method or optimizer settings.
    """
    device = device or pick_device()
    task = get_task(cfg.model.task)
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model.path)
    train_data, eval_data = build_data(cfg.data, task, tokenizer)
    labels = len(train_data.label_names)
    num_labels = cfg.model.num_labels or (labels if task.uses_labels else None)
    if task.uses_labels and cfg.model.num_labels and cfg.model.num_labels < labels:
        raise RankwiseError(f"model.num_labels is {cfg.model.num_labels} but the data has "
                            f"{labels} labels; remove num_labels to infer it")
    cfg.model.num_labels = num_labels  # resolved: config.yaml records it for export/resume
    if model is None:
        model, tokenizer = load_model(cfg.model.path, task, num_labels, seed=cfg.train.seed)
    model.to(device)
    entry = registry.get("method", cfg.method.name)
    torch.manual_seed(cfg.train.seed)
    session = Session(cfg, model, tokenizer, task, train_data, eval_data, None, None, None, device)  # type: ignore[arg-type]
    if saved is not None:
        rebuild(model, cfg.method, "default", saved.get("layers") or {}, saved.get("modules_to_save"))
    elif entry.needs_batches:
        batches = (session.batch(i, seed_offset=1) for i in range(cfg.train.calibration_batches))
        session.method_result = entry.builder(model, cfg.method, "default", batches=batches,
                                              loss_fn=task.mean_loss)
    else:
        session.method_result = entry.builder(model, cfg.method, "default")
    model.to(device)
    if not any(p.requires_grad for p in model.parameters()):
        raise RankwiseError(f"method {cfg.method.name!r} left nothing trainable; check method.targets")
    session.optimizer = registry.get("optimizer", cfg.optim.name).builder(model, cfg.optim)
    session.scheduler = linear_schedule(session.optimizer, cfg.train.steps, cfg.train.warmup_fraction)
    return session


def _check_run_folder(out: Path, resume: bool) -> None:
    if not resume and ((out / "config.yaml").exists() or list_checkpoints(out)):
        raise RankwiseError(f"run folder {out} already holds a run; pass --resume to continue it "
                            "or choose another --out")


def _check_same_config(out: Path, cfg: RunConfig) -> None:
    cfg_file = out / "config.yaml"
    if cfg_file.exists():
        saved = yaml.safe_load(cfg_file.read_text()) or {}
        now = yaml.safe_load(yaml.safe_dump(cfg.to_dict()))
        for d in (saved, now):
            d.get("train", {}).pop("progress", None)
        if (now.get("model") or {}).get("num_labels") is None and "model" in now:
            now["model"]["num_labels"] = (saved.get("model") or {}).get("num_labels")  # inferred
        if saved != now:
            diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
            raise RankwiseError(f"the config differs from {cfg_file} in section(s) {diff}; resume "
                                f"with the run's own config: rankwise train {cfg_file} --resume --out {out}")


def save_result(session: Session, out: Path) -> Path:
    """Save what the run trained: ``adapter/`` (rankwise format) or ``model/`` for full training."""
    entry = registry.get("method", session.cfg.method.name)
    if entry.trains == "full":
        with atomic.folder(out / "model") as tmp:
            session.model.save_pretrained(tmp, safe_serialization=True)
        return out / "model"
    return save_adapter(session.model, out / "adapter", session.cfg.method)


def _saver(session: Session, out: Path):
    """The checkpoint writer: trainable weights, engine state, adapter structure, time."""
    def save(engine: Engine, state) -> None:
        engine.check_finite(state.step)
        meta = {"train_time_s": state.elapsed,
                "structure": {"layers": structure(session.model), "modules_to_save": modules_to_save(session.model)}}
        save_checkpoint(out, state.step, session.model, engine.state_dict(),
                        session.cfg.train.keep_checkpoints, meta)
    return save


def train(cfg: RunConfig, out: Path, resume: bool = False, session: Session | None = None,
          console=None, summary: bool = True) -> dict:
    """Run training as configured and write the run folder.

    Args:
        cfg: The validated run config.
        out: The run folder.
        resume: Continue from the newest checkpoint in ``out``.
        session: A prepared session (default: built from ``cfg``, or from the checkpoint's
            adapter structure when resuming).
        console: A ``rich.console.Console`` for messages (default: stderr).
        summary: Print the per-layer adapter table (else one parameter-count line).

    Returns:
        The metrics written to ``metrics.json``.

    Raises:
        RankwiseError: Bad config/data/model, a run folder conflict, or a non-finite loss
            (the last good checkpoint is kept).
        KeyboardInterrupt: After writing a checkpoint, on Ctrl-C.
    """
    from rich.console import Console

    console = console or Console(stderr=True)
    out = Path(out)
    _check_run_folder(out, resume)
    if resume:
        _check_same_config(out, cfg)
    ckpts = list_checkpoints(out) if resume else []
    meta = read_meta(ckpts[-1]) if ckpts else None
    session = session or prepare(cfg, saved=(meta or {}).get("structure"))
    if summary and cfg.train.progress:
        from rankwise.core.summary import print_summary
        print_summary(session.model, console, max_rows=12)
    else:
        trainable, total = count_parameters(session.model)
        console.print(f"trainable params: {trainable:,} / {total:,} ({100 * trainable / total:.2f}%)")
    t = cfg.train
    out.mkdir(parents=True, exist_ok=True)
    log = cb.EventLog(out / "events.jsonl", t.log_every)
    callbacks = [
        cb.ProgressBar(cfg.method.name, console, tokens=not session.task.uses_labels, disable=not t.progress),
        log, cb.Evaluate(session.eval_data, t.eval_batch_size, t.eval_every, log),
    ]
    if t.early_stopping_patience:
        callbacks.append(cb.EarlyStopping("eval_loss", t.early_stopping_patience))
    callbacks += [cb.Checkpoint(_saver(session, out), t.save_every),
                  cb.Evaluate(session.eval_data, t.eval_batch_size, log=log, at_end=True),
                  cb.LossPlot(log, out / "loss.png", f"{cfg.method.name} + {cfg.optim.name}")]
    engine = session.engine(callbacks)
    start_step, prior_time = 0, 0.0
    if ckpts:
        load_checkpoint(ckpts[-1], session.model, engine)
        start_step, prior_time = int(meta["step"]), float(meta.get("train_time_s", 0.0))
        console.print(f"resuming {out} from step {start_step}")
    elif resume:
        console.print(f"no checkpoint in {out}; starting from step 0")
    if not (out / "config.yaml").exists():
        atomic.write_bytes(out / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False).encode())
    if not ckpts and hasattr(session.method_result, "write_artifacts"):
        session.method_result.write_artifacts(out)
    try:
        with PeakMemory(session.device) as mem:
            state = engine.fit(t.steps, start_step, prior_time)
    except NonFiniteLoss as err:
        last = list_checkpoints(out)
        raise RankwiseError(f"{err} (last good checkpoint: {last[-1] if last else 'none'})") from None
    except KeyboardInterrupt:
        console.print(f"interrupted; checkpoint saved. Continue with --resume --out {out}")
        raise
    save_result(session, out)
    trainable, total = count_parameters(session.model)
    metrics = {**{k: round(v, 6) for k, v in state.last_eval.items()}, "trainable_params": trainable,
               "total_params": total, "steps": state.step, "train_time_s": round(state.elapsed, 3),
               "peak_memory_mb": round(mem.peak_mb, 1), "method": cfg.method.name, "optim": cfg.optim.name}
    atomic.write_json(out / "metrics.json", metrics)
    return metrics
