"""``rankwise train``: one run from a config to a run folder.

The run folder holds ``config.yaml`` (fully resolved), ``events.jsonl`` (one line per logged
step), ``metrics.json``, ``adapter/`` (or ``model/`` for full fine-tuning), ``checkpoints/``
and ``loss.png``. Building blocks (:func:`prepare`, :func:`train_step`, :func:`evaluate`) are
reused by the demo, the comparison harness and the federated clients.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from rankwise import registry
from rankwise.core import atomic
from rankwise.core.io import save_adapter
from rankwise.core.ops import count_parameters
from rankwise.data.text import TextData, batch_indices, build_data
from rankwise.errors import RankwiseError
from rankwise.recipes.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from rankwise.recipes.config import RunConfig
from rankwise.recipes.memory import PeakMemory
from rankwise.recipes.model import load_model, load_tokenizer
from rankwise.recipes.plots import plot_loss


@dataclass
class Session:
    """Everything a training loop needs, built from a :class:`RunConfig` by :func:`prepare`."""

    cfg: RunConfig
    model: nn.Module
    tokenizer: Any
    train_data: TextData
    eval_data: TextData
    method_result: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    device: str

    def batch(self, step: int, seed_offset: int = 0) -> dict[str, torch.Tensor]:
        """The training batch of ``step`` on the session's device."""
        t = self.cfg.train
        idx = batch_indices(step, len(self.train_data), t.batch_size, t.seed + seed_offset)
        return {k: v.to(self.device) for k, v in self.train_data.batch(idx, self.cfg.model.task).items()}


def pick_device() -> str:
    """``cuda`` when available, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def linear_schedule(optimizer: torch.optim.Optimizer, steps: int, warmup_fraction: float):
    """Linear warm-up over ``warmup_fraction`` of ``steps``, then linear decay to zero."""
    warm = max(1, int(steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return max(0.0, (steps - step) / max(1, steps - warm))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def prepare(cfg: RunConfig, device: str | None = None, model=None, tokenizer=None) -> Session:
    """Load model and data, apply the method, build optimizer and schedule.

    Args:
        cfg: A validated run config.
        device: ``cpu``/``cuda`` (default: CUDA when available).
        model: An already loaded base model (skips loading; the demo reuses one).
        tokenizer: Its tokenizer.

    Returns:
        A ready :class:`Session`.

    Raises:
        RankwiseError: On any problem with the model, data, method or optimizer settings.
    """
    device = device or pick_device()
    task = cfg.model.task
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model.path)
    train_data, eval_data = build_data(cfg.data, task, tokenizer)
    num_labels = cfg.model.num_labels or (len(train_data.label_names) if task == "classification" else None)
    if task == "classification" and cfg.model.num_labels and cfg.model.num_labels < len(train_data.label_names):
        raise RankwiseError(f"model.num_labels is {cfg.model.num_labels} but the data has "
                            f"{len(train_data.label_names)} labels; remove num_labels to infer it")
    cfg.model.num_labels = num_labels  # resolved: config.yaml records it for export/resume
    if model is None:
        model, tokenizer = load_model(cfg.model.path, task, num_labels, seed=cfg.train.seed)
    model.to(device)
    entry = registry.get("method", cfg.method.name)
    torch.manual_seed(cfg.train.seed)
    session = Session(cfg, model, tokenizer, train_data, eval_data, None, None, None, device)  # type: ignore[arg-type]
    if entry.needs_batches:
        batches = (session.batch(i, seed_offset=1) for i in range(cfg.train.calibration_batches))
        session.method_result = entry.builder(model, cfg.method, "default", batches=batches)
    else:
        session.method_result = entry.builder(model, cfg.method, "default")
    model.to(device)
    if not any(p.requires_grad for p in model.parameters()):
        raise RankwiseError(f"method {cfg.method.name!r} left nothing trainable; check method.targets")
    session.optimizer = registry.get("optimizer", cfg.optim.name).builder(model, cfg.optim)
    session.scheduler = linear_schedule(session.optimizer, cfg.train.steps, cfg.train.warmup_fraction)
    return session


def train_step(session: Session, step: int) -> float:
    """One optimizer step on the batch of ``step``; returns the loss (may be non-finite)."""
    model, opt = session.model, session.optimizer
    model.train()
    out = model(**session.batch(step))
    loss = out.loss
    if not torch.isfinite(loss):
        return float(loss.detach())
    loss.backward()
    if session.cfg.train.grad_clip > 0:
        nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], session.cfg.train.grad_clip)
    if getattr(opt, "needs_closure_loss", False):  # NGN-style step sizes need the loss value
        opt.step(loss=loss.detach())
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    session.scheduler.step()
    return float(loss.detach())


@torch.no_grad()
def evaluate(model: nn.Module, data: TextData, task: str, batch_size: int, device: str) -> dict[str, float]:
    """Mean loss over ``data`` (and accuracy for classification, perplexity for causal LM)."""
    was_training = model.training
    model.eval()
    total_loss = correct = count = tokens = 0.0
    for start in range(0, len(data), batch_size):
        idx = list(range(start, min(start + batch_size, len(data))))
        batch = {k: v.to(device) for k, v in data.batch(idx, task).items()}
        out = model(**batch)
        if task == "classification":
            total_loss += float(out.loss) * len(idx)
            correct += float((out.logits.argmax(-1) == batch["labels"]).sum())
            count += len(idx)
        else:
            n = float((batch["labels"][:, 1:] != -100).sum())
            total_loss += float(out.loss) * n
            tokens += n
    model.train(was_training)
    if task == "classification":
        return {"eval_loss": total_loss / count, "eval_accuracy": correct / count}
    loss = total_loss / max(tokens, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}


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
        if saved != now:
            diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
            raise RankwiseError(f"the config differs from {cfg_file} in section(s) {diff}; resume "
                                f"with the run's own config: rankwise train {cfg_file} --resume --out {out}")


def _read_events(path: Path, upto: int) -> list[dict]:
    if not path.is_file():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("step", 0) <= upto]


def save_result(session: Session, out: Path) -> Path:
    """Save what the run trained: ``adapter/`` (rankwise format) or ``model/`` for full training."""
    entry = registry.get("method", session.cfg.method.name)
    if entry.trains == "full":
        with atomic.folder(out / "model") as tmp:
            session.model.save_pretrained(tmp, safe_serialization=True)
        return out / "model"
    return save_adapter(session.model, out / "adapter", session.cfg.method)


def train(cfg: RunConfig, out: Path, resume: bool = False, session: Session | None = None,
          console=None, summary: bool = True) -> dict:
    """Run training as configured and write the run folder.

    Args:
        cfg: The validated run config.
        out: The run folder.
        resume: Continue from the newest checkpoint in ``out``.
        session: A prepared session (default: built from ``cfg``).
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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = console or Console(stderr=True)
    out = Path(out)
    _check_run_folder(out, resume)
    session = session or prepare(cfg)
    if resume:
        _check_same_config(out, cfg)
    if summary and cfg.train.progress:
        from rankwise.core.summary import print_summary
        print_summary(session.model, console, max_rows=12)
    else:
        trainable, total = count_parameters(session.model)
        console.print(f"trainable params: {trainable:,} / {total:,} ({100 * trainable / total:.2f}%)")
    t = cfg.train
    out.mkdir(parents=True, exist_ok=True)
    start_step, prior_time = 0, 0.0
    ckpts = list_checkpoints(out) if resume else []
    if ckpts:
        meta = load_checkpoint(ckpts[-1], session.model, session.optimizer, session.scheduler)
        start_step, prior_time = int(meta["step"]), float(meta.get("train_time_s", 0.0))
        console.print(f"resuming {out} from step {start_step}")
    elif resume:
        console.print(f"no checkpoint in {out}; starting from step 0")
    if not (out / "config.yaml").exists():
        atomic.write_bytes(out / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False).encode())
    if hasattr(session.method_result, "write_artifacts"):
        session.method_result.write_artifacts(out)
    events_path = out / "events.jsonl"
    events = _read_events(events_path, start_step)
    atomic.write_bytes(events_path, "".join(json.dumps(e) + "\n" for e in events).encode())
    log = events_path.open("a")

    def checkpoint(step: int, elapsed: float) -> None:
        save_checkpoint(out, step, session.model, session.optimizer, session.scheduler,
                        t.keep_checkpoints, {"train_time_s": elapsed})

    step, began = start_step, time.perf_counter()
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[speed]:.1f} ex/s"),
               TimeRemainingColumn()]
    try:
        with PeakMemory(session.device) as mem, Progress(*columns, console=console, disable=not t.progress,
                                                          transient=False) as bar:
            task_id = bar.add_task(cfg.method.name, total=t.steps, completed=start_step, loss=float("nan"), speed=0.0)
            while step < t.steps:
                loss = train_step(session, step)
                if not math.isfinite(loss):
                    last = list_checkpoints(out)
                    raise RankwiseError(
                        f"loss became {loss} at step {step + 1}; lower optim.lr or train.grad_clip "
                        f"(last good checkpoint: {last[-1] if last else 'none'})")
                step += 1
                elapsed = prior_time + time.perf_counter() - began
                speed = (step - start_step) * t.batch_size / max(time.perf_counter() - began, 1e-9)
                bar.update(task_id, completed=step, loss=loss, speed=speed)
                if step % max(t.log_every, 1) == 0 or step == t.steps:
                    log.write(json.dumps({"step": step, "loss": loss, "lr": session.scheduler.get_last_lr()[0],
                                          "elapsed_s": round(elapsed, 3)}) + "\n")
                    log.flush()
                if t.eval_every and step % t.eval_every == 0 and step < t.steps:
                    ev = evaluate(session.model, session.eval_data, cfg.model.task, t.eval_batch_size, session.device)
                    log.write(json.dumps({"step": step, **ev}) + "\n")
                    log.flush()
                if t.save_every and step % t.save_every == 0 and step < t.steps:
                    checkpoint(step, elapsed)
    except KeyboardInterrupt:
        checkpoint(step, prior_time + time.perf_counter() - began)
        console.print(f"interrupted at step {step}; checkpoint saved. Continue with --resume --out {out}")
        raise
    finally:
        log.close()
    train_time = prior_time + time.perf_counter() - began
    checkpoint(step, train_time)
    final = evaluate(session.model, session.eval_data, cfg.model.task, t.eval_batch_size, session.device)
    with events_path.open("a") as f:
        f.write(json.dumps({"step": step, **final}) + "\n")
    save_result(session, out)
    trainable, total = count_parameters(session.model)
    metrics = {**{k: round(v, 6) for k, v in final.items()}, "trainable_params": trainable,
               "total_params": total, "steps": step, "train_time_s": round(train_time, 3),
               "peak_memory_mb": round(mem.peak_mb, 1), "method": cfg.method.name, "optim": cfg.optim.name}
    atomic.write_json(out / "metrics.json", metrics)
    plot_loss(_read_events(events_path, step), out / "loss.png", title=f"{cfg.method.name} + {cfg.optim.name}")
    return metrics
