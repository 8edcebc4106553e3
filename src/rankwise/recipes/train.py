"""``rankwise train``: one run from a config to a run folder.

The run folder holds ``config.yaml`` (fully resolved), ``events.jsonl`` (one line per logged
step), ``metrics.json``, ``adapter/`` (or ``model/`` for full fine-tuning), ``checkpoints/``
and ``loss.png``. :func:`rankwise.recipes.session.prepare` builds the pieces from a config
(model, data, method, optimizer); the loop itself is :class:`rankwise.engine.Engine`, and
everything around it (logging, evaluation, checkpoints, plot, progress) is one of its
callbacks. This module owns the run folder: which folder may take a run, resume, saving.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
import yaml

from rankwise import registry
from rankwise.core import atomic
from rankwise.core.io import save_adapter, structure
from rankwise.core.ops import count_parameters, modules_to_save
from rankwise.engine import Engine, NonFiniteLoss
from rankwise.engine import callbacks as cb
from rankwise.engine.distributed import Distributed
from rankwise.engine.distributed import setup as setup_distributed
from rankwise.engine.threads import local_processes, use_threads
from rankwise.errors import RankwiseError
from rankwise.memory import PeakMemory
from rankwise.recipes import folders, optim_scope, yamlfile
from rankwise.recipes.checkpoint import list_checkpoints, load_checkpoint, read_meta, save_checkpoint
from rankwise.recipes.checkpoint import clean_incomplete
from rankwise.recipes.config import RunConfig, build_run_config
from rankwise.recipes.model import starts_random
from rankwise.recipes.reports import check_reporting, data_info, finish_trackers, report_callbacks
from rankwise.recipes.resume import dotted_diff, schedule_factor, set_schedule
from rankwise.recipes.session import Session, auto_compile, prepare
from rankwise.recipes.tokens import TOKENIZER_DIR, adds_tokens, save_tokenizer
from rankwise.recipes.tokens import save_tokenizer_files


def run_trained_tokenizer(cfg: RunConfig, out: Path, dist: Distributed, console) -> Any:
    """``model.train_tokenizer``: the run's tokenizer, learned from the training text on the
    first start (rank 0 learns it while the others wait) and read back from ``RUN/tokenizer``
    on every later one, so a resumed run tokenizes exactly as it began; ``None`` without it."""
    tok_cfg = cfg.model.train_tokenizer
    if tok_cfg is None:
        return None
    from transformers import AutoTokenizer

    from rankwise.data.text import training_texts
    from rankwise.data.tokenizer import train_tokenizer
    folder = out / TOKENIZER_DIR
    with dist.main_first():
        if not folder.is_dir():
            console.print(f"learning a {tok_cfg.kind} tokenizer of {tok_cfg.vocab_size:,} tokens from "
                          f"the training text of {cfg.data.source}", soft_wrap=True)
            if dist.is_main:
                train_tokenizer(training_texts(cfg.data), tok_cfg, folder)
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok


def _check_not_the_base(out: Path, cfg: RunConfig) -> None:
    """Refuse an ``--out`` that is, or contains, the base model's folder (a full fine-tuning run
    would write over the base weights)."""
    base = Path(cfg.model.path).expanduser()
    if not base.is_dir():
        return  # a built-in name (demo, tiny-*)
    base, target = base.resolve(), out.expanduser().resolve()
    if base == target or target in base.parents:
        raise RankwiseError(f"--out {out} contains the base model folder {cfg.model.path} "
                            "(model.path); choose another --out so the base is never overwritten")


def _check_run_folder(out: Path, resume: bool, console, write: bool = True) -> bool:
    """Check ``out`` can take this run; return whether to resume.

    A folder that holds anything but a train run (a federated run, a compress output, an
    export, the demo, a comparison, other files) is refused, with or without ``--resume``. A
    folder that holds a finished run (``metrics.json``) or a checkpoint needs ``--resume``. A
    run that failed before its first checkpoint (only ``config.yaml`` and ``events.jsonl``) has
    nothing to continue from: a new run replaces it (said on the console), whatever its config;
    only the writing process (``write``, rank 0 under torchrun) removes its files.
    """
    if folders.kind(out) == "federated":  # continued by its own command, never by train
        fix = ("it is finished: choose another --out" if (out / "metrics.json").exists() else
               f"continue it with: rankwise federated {out / 'config.yaml'} --out {out} --resume "
               "(or choose another --out)")
        raise RankwiseError(f"--out {out} holds {folders.WHAT['federated']}, not a train run; {fix}")
    folders.check_kind(out, "train", "train writes only into a new or empty folder or its own run "
                       "folder: choose another --out")
    if not (out / "config.yaml").exists() and not list_checkpoints(out):
        return resume
    if list_checkpoints(out) or (out / "metrics.json").exists():
        if not resume:
            raise RankwiseError(f"run folder {out} already holds a run; pass --resume to continue "
                                "it or choose another --out")
        return True
    if write:
        console.print(f"{out} holds a run that stopped before its first checkpoint; starting over")
        for name in ("config.yaml", "events.jsonl", "loss.png"):
            (out / name).unlink(missing_ok=True)
    return False


def _check_same_config(out: Path, cfg: RunConfig) -> int | None:
    """Refuse a config that differs from the run's own, naming each differing key; only
    ``train.steps`` may change (:mod:`rankwise.recipes.resume`). Return the run's own
    ``train.steps`` when it changes, else ``None``."""
    cfg_file = out / "config.yaml"
    if cfg_file.exists():
        saved = yamlfile.load(cfg_file.read_text()) or {}
        try:  # fill keys added since the run was written with their defaults
            saved = yaml.safe_load(yaml.safe_dump(build_run_config(saved, notice=False).to_dict()))
        except RankwiseError:
            pass  # compared as written
        now = yaml.safe_load(yaml.safe_dump(cfg.to_dict()))
        for d in (saved, now):
            d.get("train", {}).pop("progress", None)
            d.get("train", {}).pop("threads", None)  # how fast, not what: a resume may change it
            d.get("train", {}).pop("loss_chunk_tokens", None)  # how, not what: same loss
            d.get("train", {}).pop("log_to", None)  # where it is reported, not what trains
            d.get("task", {}).pop("rewards_dir", None)  # where the config was read: same rewards
            if (now.get("model") or {}).get("adapter"):  # the method is model.adapter's, read
                d.pop("method", None)                    # again by prepare (config.yaml has it)
        if (now.get("model") or {}).get("num_labels") is None and "model" in now:
            now["model"]["num_labels"] = (saved.get("model") or {}).get("num_labels")  # inferred
        diff = [k for k in dotted_diff(saved, now) if k != "train.steps"]
        if diff:
            raise RankwiseError(f"the config differs from {cfg_file} in {_keys(diff, saved, now)} "
                                "(only train.steps may change on --resume); resume with the run's "
                                f"own config: rankwise train {cfg_file} --resume --out {out}")
        if saved.get("train", {}).get("steps") != now["train"]["steps"]:
            return int(saved["train"]["steps"])
    return None


def _keys(diff: list[str], saved: dict, now: dict, shown: int = 4) -> str:
    """``optim.lr (0.1 here, 0.005 in the run), ...`` for the first ``shown`` keys."""
    def get(d, key):
        for part in key.split("."):
            d = d.get(part) if isinstance(d, dict) else None
        return d
    parts = [f"{k} ({get(now, k)!r} here, {get(saved, k)!r} in the run)" for k in diff[:shown]]
    return ", ".join(parts) + (f" and {len(diff) - shown} more" if len(diff) > shown else "")


def save_result(session: Session, out: Path) -> Path:
    """Save what the run trained: ``adapter/`` (rankwise format) or ``model/`` for full training.

    Every process calls it, inside ``dist.full_params``: under FSDP2 the full model's state dict
    is gathered by all of them (its hooks hand out sharded tensors), and rank 0 writes."""
    dist = session.dist
    entry = registry.get("method", session.cfg.method.name)
    if entry.trains == "full":
        state = None
        if dist.active and dist.kind == "fsdp":
            model = session.model  # a tied weight (embeddings and head) is written once
            tied = ({n for n, _ in model.named_parameters(remove_duplicate=False)}
                    - {n for n, _ in model.named_parameters()})
            state = {k: dist.full_state(v) for k, v in model.state_dict().items() if k not in tied}
        if dist.is_main:
            with atomic.folder(out / "model") as tmp:
                session.model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
                save_tokenizer_files(session.tokenizer, tmp)  # a complete folder: generate / transformers load it
        return out / "model"
    if not dist.is_main:
        return out / "adapter"
    return save_adapter(session.model, out / "adapter", session.cfg.method)


def _saver(session: Session, out: Path, measure: cb.MeasureMemory):
    """The checkpoint writer: trainable weights, engine state, adapter structure, time, the
    peaks so far (under torchrun: every process's RNG and the world size; rank 0 writes,
    sharded tensors gathered)."""
    dist = session.dist

    def save(engine: Engine, state) -> None:
        engine.check_finite(state.step)
        engine_state = engine.state_dict()
        if dist.active:
            engine_state["torch_rng_ranks"] = dist.rng_states()
        engine_state = dist.full_state(engine_state)
        peaks = measure.peaks()
        with dist.full_params(session.model):
            if dist.is_main:
                meta = {"train_time_s": state.elapsed, "world_size": dist.world, **peaks,
                        "structure": {"layers": structure(session.model),
                                      "modules_to_save": modules_to_save(session.model)}}
                if session.schedule_extensions:  # a later resume rebuilds the same schedule
                    meta["schedule_extensions"] = session.schedule_extensions
                save_checkpoint(out, state.step, session.model, engine_state,
                                session.cfg.train.keep_checkpoints, meta)
    return save


def _resume(ckpt: Path, meta: dict, session: Session, engine: Engine) -> None:
    """Load checkpoint ``ckpt`` into every process (its own RNG stream under torchrun)."""
    dist = session.dist
    world = int(meta.get("world_size", 1))
    if world != dist.world:
        raise RankwiseError(f"{ckpt} was written by a run of {world} process(es); resume it with "
                            f"{world} (torchrun --nproc-per-node), not {dist.world}")
    with dist.full_params(session.model):
        load_checkpoint(ckpt, session.model, engine)
    dist.reshard_optimizer(engine.optimizer)
    if dist.active:
        torch.set_rng_state(torch.load(ckpt / "state.pt", weights_only=True)["torch_rng_ranks"][dist.rank])


class RunFinished(RankwiseError):
    """``--resume`` of a run that has finished (its ``metrics.json`` exists) with the same
    ``train.steps`` and an intact result: there is nothing to do (the CLI says so, exit 0)."""


def _result_intact(out: Path, cfg: RunConfig) -> bool:
    """Whether the run's ``adapter/`` (or ``model/``) reads back."""
    from safetensors import safe_open

    from rankwise.core.io import read_adapter
    try:
        if registry.get("method", cfg.method.name).trains == "full":
            files = list((out / "model").glob("*.safetensors"))
            for f in files:
                with safe_open(str(f), "pt") as handle:
                    handle.keys()
            return bool(files) and (out / "model" / "config.json").is_file()
        read_adapter(out / "adapter")
        return True
    except Exception:  # noqa: BLE001 - any unreadable result is rewritten from the checkpoint
        return False


def _check_extension(out: Path, cfg: RunConfig, resume: bool, old_steps: int | None,
                     meta: dict | None) -> bool:
    """Refuse resuming a finished run without raising ``train.steps`` (nothing would be
    trained; the final evaluation would be appended again), or lowering it below the steps
    already done. Return whether the run is finished but its result must be written again
    from the checkpoint (what ``export`` suggests for a corrupt adapter)."""
    done = int(meta["step"]) if meta else 0
    if resume and old_steps is None and (out / "metrics.json").exists():
        if meta is not None and not _result_intact(out, cfg):
            return True
        raise RunFinished(f"{out} is a finished run ({done} of {cfg.train.steps} steps, metrics.json); "
                          "nothing to resume. To train it further, raise train.steps: --resume "
                          f"--out {out} --set train.steps={2 * cfg.train.steps}")
    if old_steps is not None and cfg.train.steps < done:
        raise RankwiseError(f"train.steps {cfg.train.steps} is below the {done} steps {out} has done; "
                            f"set train.steps to at least {done}")
    return False


def _continue_schedule(session: Session, engine: Engine, meta: dict, old_steps: int | None,
                       console) -> None:
    """Give the resumed scheduler the run's learning-rate schedule when ``train.steps`` changed,
    now or on an earlier resume (:mod:`rankwise.recipes.resume`)."""
    t = session.cfg.train
    session.schedule_extensions = [tuple(e) for e in meta.get("schedule_extensions", [])]
    if old_steps is not None:
        session.schedule_extensions.append((old_steps, int(meta["step"])))
        console.print(f"train.steps {old_steps} -> {t.steps}: lr ramps to the new schedule in "
                      f"{max(1, int(t.steps * t.warmup_fraction))} step(s)", soft_wrap=True)
    if session.schedule_extensions:
        set_schedule(engine.scheduler, schedule_factor(t.steps, t.warmup_fraction,
                                                       session.schedule_extensions))


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
        RunFinished: ``resume`` of a finished run whose ``train.steps`` is unchanged.
        KeyboardInterrupt: After writing a checkpoint, on Ctrl-C.
    """
    from rich.console import Console

    dist = session.dist if session is not None else setup_distributed(
        cfg.train.distributed, cfg.train.distributed_timeout_s)
    main = dist.is_main  # under torchrun only rank 0 writes the run folder and talks
    console = console or Console(stderr=True, quiet=not main)
    out = atomic.check_folder(out)  # a file, a path under a file, no permission: before the lock
    check_reporting(cfg)  # a tracker's missing package: one line before anything loads
    _check_not_the_base(out, cfg)
    # one process per run folder: a second `rankwise train --out` the same folder stops here,
    # before loading anything, instead of interleaving two runs' files
    with atomic.locked_folder(out) if main else contextlib.nullcontext(), \
            use_threads(cfg.train.threads, local_processes()):
        return _train(cfg, out, resume, session, console, summary, dist)


def _train(cfg: RunConfig, out: Path, resume: bool, session: Session | None, console,
           summary: bool, dist) -> dict:
    """:func:`train` once the run folder is this process's."""
    main = dist.is_main
    resume, old_steps, ckpts, meta, rewrite = _folder_state(cfg, out, resume, console, main)
    dist.barrier()  # every process has checked the folder before rank 0 writes to it
    session = _open_session(cfg, out, session, ckpts, meta, console, summary, dist)
    engine, mem, measure = _build_engine(cfg, out, session, console, dist)
    start_step, prior_time = _restore_state(out, resume, ckpts, meta, old_steps, session, engine,
                                            measure, console)
    if session.scope is not None:
        console.print(optim_scope.describe(session.scope, cfg.optim.name), soft_wrap=True)
    if cfg.train.offload_activations and engine.offloader is not None and not engine.offloader.active:
        console.print(f"train.offload_activations: no effect on device {session.device} "
                      "(activations already live in CPU memory)", soft_wrap=True)
    if main:
        _write_first_files(cfg, out, session, ckpts, old_steps)
    if rewrite:  # a finished run whose adapter/ (model/) is unreadable: write it again, only that
        with dist.guard(), dist.full_params(session.model):
            written = save_result(session, out)
            if main:
                console.print(f"{out} is finished; wrote {written} again from the checkpoint of "
                              f"step {start_step}")
        return json.loads((out / "metrics.json").read_text())
    state = _fit(cfg, out, engine, mem, measure, start_step, prior_time, console, dist)
    return _finish(cfg, out, session, engine, state, mem, measure, console, dist)


def _folder_state(cfg: RunConfig, out: Path, resume: bool, console, main: bool) -> tuple:
    """Check the run folder; ``(resume, old_steps, checkpoints, last meta, rewrite)``."""
    is_run = (out / "config.yaml").exists()
    resume = _check_run_folder(out, resume, console, write=main)
    if main and (resume or is_run):
        for partial in clean_incomplete(out):  # a kill during checkpoint rotation
            console.print(f"removed the incomplete checkpoint {partial}")
    old_steps = _check_same_config(out, cfg) if resume else None
    ckpts = list_checkpoints(out) if resume else []
    meta = read_meta(ckpts[-1]) if ckpts else None
    rewrite = _check_extension(out, cfg, resume, old_steps, meta)
    return resume, old_steps, ckpts, meta, rewrite


def _open_session(cfg: RunConfig, out: Path, session: Session | None, ckpts: list, meta: dict | None,
                  console, summary: bool, dist) -> Session:
    """The tokenizer and the session (unless given), then the parameter and data lines."""
    tokenizer = run_trained_tokenizer(cfg, out, dist, console) if session is None else None
    if starts_random(cfg.model.path, cfg.model.init) and not ckpts:
        console.print(f"model.path {cfg.model.path}: starting from random weights (seed "
                      f"{cfg.train.seed}), as model.init: {cfg.model.init} says", soft_wrap=True)
    session = session or prepare(cfg, saved=(meta or {}).get("structure"), dist=dist, tokenizer=tokenizer)
    if summary and cfg.train.progress:
        from rankwise.core.summary import print_summary
        print_summary(session.model, console, max_rows=12)
    else:
        trainable, total = count_parameters(session.model)
        console.print(f"trainable params: {trainable:,} / {total:,} ({100 * trainable / total:.2f}%)")
    dropped = data_info(session)["dropped_too_long"]
    if dropped:
        console.print(f"dropped {dropped} records whose completion alone exceeds data.max_length="
                      f"{cfg.data.max_length} (counted in events.jsonl and metrics.json)")
    return session


def _build_engine(cfg: RunConfig, out: Path, session: Session, console, dist) -> tuple:
    """The engine with the run's callbacks; ``(engine, peak memory, its MeasureMemory)``."""
    t, main = cfg.train, dist.is_main
    out.mkdir(parents=True, exist_ok=True)
    log = cb.EventLog(out / "events.jsonl", t.log_every) if main else None
    mem = PeakMemory(session.device)  # the steps' peak; evaluations apart (MeasureMemory)
    measure = cb.MeasureMemory(mem)
    callbacks = [
        cb.ProgressBar(cfg.method.name, console, tokens=not session.task.uses_labels,
                       disable=not (t.progress and main)),
        log, cb.Evaluate(session.eval_data, t.eval_batch_size, t.eval_every, log, memory=measure),
    ]
    callbacks.insert(0, auto_compile(session, console.print))  # train.compile: auto (or None)
    if t.early_stopping_patience:
        callbacks.append(cb.EarlyStopping("eval_loss", t.early_stopping_patience))
    callbacks += [cb.Checkpoint(_saver(session, out, measure), t.save_every),
                  cb.Evaluate(session.eval_data, t.eval_batch_size, log=log, at_end=True,
                              memory=measure),
                  cb.LossPlot(log, out / "loss.png", f"{cfg.method.name} + {cfg.optim.name}") if main else None]
    callbacks += report_callbacks(session, out, log, write=main, console=console)  # data, samples, trackers
    if t.distributed_step_timeout_s is not None and dist.active:
        from rankwise.engine.distributed import StepTimeout
        callbacks.append(StepTimeout(dist, t.distributed_step_timeout_s))
    return session.engine([c for c in callbacks if c is not None]), mem, measure


def _restore_state(out: Path, resume: bool, ckpts: list, meta: dict | None, old_steps: int | None,
                   session: Session, engine: Engine, measure: cb.MeasureMemory, console) -> tuple:
    """Load the last checkpoint, if any; ``(start step, prior training seconds)``."""
    start_step, prior_time = 0, 0.0
    if ckpts:
        _resume(ckpts[-1], meta, session, engine)
        start_step, prior_time = int(meta["step"]), float(meta.get("train_time_s", 0.0))
        measure.restore(meta)  # the peaks of the steps trained before
        console.print(f"resuming {out} from step {start_step}")
        _continue_schedule(session, engine, meta, old_steps, console)
    elif resume:
        console.print(f"no checkpoint in {out}; starting from step 0")
    return start_step, prior_time


def _write_first_files(cfg: RunConfig, out: Path, session: Session, ckpts: list,
                       old_steps: int | None) -> None:
    """Rank 0: the folder record, config.yaml, the extended tokenizer and method artifacts."""
    if folders.read_record(out) is None:
        folders.record(out, "train")
    if old_steps is not None or not (out / "config.yaml").exists():
        atomic.write_bytes(out / "config.yaml", yamlfile.dump(cfg.to_dict(), sort_keys=False).encode())
    if adds_tokens(cfg.model) and not (out / "tokenizer").is_dir():
        save_tokenizer(session.tokenizer, out)  # the extended tokenizer: export and generate use it
    if not ckpts and hasattr(session.method_result, "write_artifacts"):
        session.method_result.write_artifacts(out)


def _fit(cfg: RunConfig, out: Path, engine: Engine, mem: PeakMemory, measure: cb.MeasureMemory,
         start_step: int, prior_time: float, console, dist):
    """Run the steps; a non-finite loss names the last good checkpoint, Ctrl-C how to resume."""
    engine.callbacks.append(measure)
    try:
        with mem, dist.guard():
            return engine.fit(cfg.train.steps, start_step, prior_time)
    except NonFiniteLoss as err:
        last = list_checkpoints(out)
        raise RankwiseError(f"{err} (last good checkpoint: {last[-1] if last else 'none'})") from None
    except KeyboardInterrupt:
        console.print(f"interrupted; checkpoint saved. Continue with --resume --out {out}")
        raise


def _finish(cfg: RunConfig, out: Path, session: Session, engine: Engine, state, mem: PeakMemory,
            measure: cb.MeasureMemory, console, dist) -> dict:
    """Save the result, write metrics.json, close the trackers, print plan's prediction."""
    main = dist.is_main
    with dist.guard(), dist.full_params(session.model):
        save_result(session, out)
        trainable, total = count_parameters(session.model)
    metrics = {**{k: round(v, 6) for k, v in state.last_eval.items()}, "trainable_params": trainable,
               "total_params": total, "steps": state.step, "train_time_s": round(state.elapsed, 3),
               **measure.peaks(),
               "method": cfg.method.name, "optim": cfg.optim.name, **data_info(session),
               **optim_scope.metrics(session.scope)}
    if main:
        atomic.write_json(out / "metrics.json", metrics)
        finish_trackers(engine.callbacks, metrics)  # train.log_to: the final metrics, then close
    if main and cfg.train.progress and console.is_terminal:  # plan's prediction beside the measurement
        # (docs/plan.md); for a person at a terminal: a meta forward costs ~0.3 s
        from rankwise.recipes.planner import predicted_train_peak_mb
        predicted = predicted_train_peak_mb(cfg, session.device, dist.world)
        if predicted is not None:
            console.print(f"peak memory {metrics['peak_memory_mb']:.1f} MiB ({mem.meter}); rankwise plan "
                          f"predicted {predicted:.1f} MiB for the training steps at data.max_length="
                          f"{cfg.data.max_length} (evaluation is not planned)")
    return metrics
