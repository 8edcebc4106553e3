"""``rankwise train``: one run from a config to a run folder.

The run folder holds ``config.yaml`` (fully resolved), ``events.jsonl`` (one line per logged
step), ``metrics.json``, ``adapter/`` (or ``model/`` for full fine-tuning), ``checkpoints/``
and ``loss.png``. :func:`prepare` builds the pieces from a config (model, data, method,
optimizer); the loop itself is :class:`rankwise.engine.Engine`, and everything around it
(logging, evaluation, checkpoints, plot, progress) is one of its callbacks.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from rankwise import registry
from rankwise.core import atomic
from rankwise.core.io import rebuild, save_adapter, structure
from rankwise.core.ops import count_parameters, modules_to_save
from rankwise.data.packing import packed_training_data
from rankwise.data.text import TextData, build_data
from rankwise.engine import Engine, NonFiniteLoss, Task, get_task, linear_schedule
from rankwise.engine.chunked_loss import vocab_size
from rankwise.engine.loop import draw_batches
from rankwise.engine import callbacks as cb
from rankwise.engine.distributed import Distributed
from rankwise.engine.distributed import setup as setup_distributed
from rankwise.engine.compile import compile_model, compile_problem
from rankwise.engine.precision import precision_problem
from rankwise.engine.neftune import add_neftune
from rankwise.engine.skrull import Skrull
from rankwise.engine.threads import local_processes, use_threads
from rankwise.errors import RankwiseError
from rankwise.memory import PeakMemory
from rankwise.recipes import folders, optim_scope, yamlfile
from rankwise.recipes.checkpoint import list_checkpoints, load_checkpoint, read_meta, save_checkpoint
from rankwise.recipes.checkpoint import clean_incomplete
from rankwise.recipes.config import RunConfig, build_run_config
from rankwise.recipes.model import enable_checkpointing, load_model, load_tokenizer, starts_random
from rankwise.recipes.reports import check_reporting, data_info, finish_trackers, report_callbacks
from rankwise.recipes.resume import dotted_diff, schedule_factor, set_schedule
from rankwise.recipes.start import check_method, load_start
from rankwise.recipes.tokens import TOKENIZER_DIR, adds_tokens, apply_trainable_tokens, save_tokenizer
from rankwise.recipes.tokens import save_tokenizer_files


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
    dist: Distributed = field(default_factory=Distributed)
    scope: optim_scope.Scope | None = None  # what the optimizer updates its own way
    schedule_extensions: list = field(default_factory=list)  # (train.steps before, at) per change
    sampler: Any = None  # data.order: gain-rl's sampler, built once (tasks/grpo/gain_rl.py)

    def batch(self, step: int, seed_offset: int = 0) -> dict[str, torch.Tensor]:
        """The collated training batch of ``step`` on the session's device (one batch, every
        process's examples: the calibration of data-driven methods)."""
        t = self.cfg.train
        return draw_batches(self.train_data, self.task, step, t.batch_size, t.seed + seed_offset,
                            self.device)[0]

    def engine(self, callbacks: list | None = None) -> Engine:
        """The :class:`~rankwise.engine.Engine` configured by ``cfg.train``."""
        t = self.cfg.train
        return Engine(self.model, self.task, self.optimizer, self.train_data, t.batch_size,
                      seed=t.seed, scheduler=self.scheduler, device=self.device,
                      callbacks=callbacks or [], dist=self.dist, schedule=self.schedule(),
                      **engine_settings(self.cfg))

    def schedule(self) -> Skrull | None:
        """The step schedule of ``data.schedule`` for this process (``None``: draw order)."""
        d, dist = self.cfg.data, self.dist
        if d.order == "gain-rl":
            return self.gain_rl()
        if d.schedule != "skrull":
            return None
        return Skrull.for_model(self.model, dist.world, dist.rank, self.cfg.train.grad_accum,
                                d.schedule_linear, d.schedule_bucket)

    def gain_rl(self):
        """GAIN-RL's sampler over the training prompts (their angle signals under the model as
        it is now; a resumed run restores the saved ones). One process only."""
        if self.sampler is None:
            from rankwise.tasks.grpo.gain_rl import GainRLSampler, prompt_signals
            if self.dist.active:
                raise RankwiseError("data.order: gain-rl samples from one process's view of the "
                                    "rewards; run it without torchrun or set data.order: uniform")
            g = self.cfg.task.gain_rl
            scores = prompt_signals(self.model, self.train_data.prompts, g, self.device)
            self.sampler = GainRLSampler(scores, g, self.cfg.train.grad_accum, self.cfg.train.seed)
            self.task.sampler = self.sampler
        return self.sampler

    def evaluate(self) -> dict[str, float]:
        """The task's metrics on the evaluation split."""
        return self.engine().evaluate(self.eval_data, self.cfg.train.eval_batch_size)


def engine_settings(cfg: RunConfig) -> dict[str, Any]:
    """The :class:`~rankwise.engine.Engine` arguments a run config sets, for every loop that
    trains a run's model: :meth:`Session.engine` and the federated clients' local training
    (``rankwise.federated.task.local_train``), so a setting cannot reach one and not the other.

    Args:
        cfg: A validated run config (``train.grad_clip`` already resolved from ``auto``).

    Returns:
        ``grad_accum``, ``grad_clip``, ``precision``, ``offload_activations`` and ``per_layer``
        (``optim.per_layer``) as keyword arguments.
    """
    t = cfg.train
    return {"grad_accum": t.grad_accum, "grad_clip": t.grad_clip, "precision": t.precision,
            "offload_activations": t.offload_activations,
            "per_layer": getattr(cfg.optim, "per_layer", False)}


def check_distributed(cfg: RunConfig, dist: Distributed) -> None:
    """Raise if the run cannot be split over torchrun's processes (see ``Distributed.problem``)."""
    problem = dist.problem(cfg.train.batch_size, cfg.train.grad_accum, cfg.optim.name)
    if problem is None and dist.active and dist.kind == "fsdp" and getattr(cfg.optim, "state_bits", None):
        problem = FSDP_STATE_BITS  # MatrixAdamW sees no matrices among FSDP2's sharded parameters
    if problem:
        raise RankwiseError(problem)


FSDP_STATE_BITS = ("optim.state_bits: 8 does not run on FSDP2's sharded parameters; use "
                   "train.distributed: ddp or set optim.state_bits: null")


def pick_device() -> str:
    """``cuda`` when available, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare(cfg: RunConfig, device: str | None = None, model=None, tokenizer=None,
            saved: dict | None = None, dist: Distributed | None = None,
            selected: dict | None = None) -> Session:
    """Load model and data, apply the method, build optimizer and schedule.

    Args:
        cfg: A validated run config.
        device: ``cpu``/``cuda`` (default: CUDA when available).
        model: An already loaded base model (skips loading; the demo reuses one).
        tokenizer: Its tokenizer.
        saved: The adapter structure a checkpoint recorded (``{"layers", "modules_to_save"}``):
            the method's layers are rebuilt from it instead of being initialised again (a
            resumed GoRA run keeps its ranks; no calibration is repeated).
        dist: This process's place under torchrun (default: a single process). Rank 0
            tokenizes first (the others reuse the cache); the model is then made identical on
            every process (``ddp``) or sharded (``fsdp``) before the optimizer is built.
        selected: Receives ``selection`` and ``full`` (the training data before it) when
            ``data.select`` chose records (``rankwise select``).

    Returns:
        A ready :class:`Session`.

    Raises:
        RankwiseError: On any problem with the model, data, method or optimizer settings.
    """
    dist = dist or Distributed()
    check_distributed(cfg, dist)
    device = device or (dist.device() if dist.active else pick_device())
    problem = precision_problem(cfg.train.precision, device)
    if problem:
        raise RankwiseError(problem)
    task = get_task(cfg.task)
    task.model_loader = lambda path, dev: load_model(path, "causal-lm", seed=cfg.train.seed,  # as model.path
                                                     device=dev)[0].to(dev).eval()  # (memory decoder's base)
    if tokenizer is None and cfg.model.train_tokenizer is not None:
        raise RankwiseError("model.train_tokenizer is learned by rankwise train into its run folder; "
                            "train first, then point model.path at the run's model/ folder")
    trained_tokenizer = tokenizer if cfg.model.train_tokenizer is not None else None
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model.path, cfg.model.add_tokens, cfg.model.add_special_tokens)
    with dist.main_first():
        train_data, eval_data = build_data(cfg.data, task, tokenizer,
                                           progress=cfg.train.progress and dist.is_main)
    labels = len(train_data.label_names)
    num_labels = cfg.model.num_labels or (labels if task.uses_labels else None)
    if task.uses_labels and cfg.model.num_labels and cfg.model.num_labels < labels:
        raise RankwiseError(f"model.num_labels is {cfg.model.num_labels} but the data has "
                            f"{labels} labels; remove num_labels to infer it")
    cfg.model.num_labels = num_labels  # resolved: config.yaml records it for export/resume
    m = cfg.model
    if model is None:
        model, tokenizer = load_model(m.path, task, num_labels, seed=cfg.train.seed, dtype=m.dtype,
                                      quantize=m.quantize, double_quant=m.double_quant, device=device,
                                      add_tokens=m.add_tokens, add_special_tokens=m.add_special_tokens,
                                      init=m.init, tokenizer=trained_tokenizer)
    if not m.quantize:  # a quantized model was loaded onto the device (bitsandbytes moves it)
        model.to(device)
    if hasattr(task, "loss_chunk_tokens"):  # causal LM: chunked loss above a vocabulary size
        task.loss_chunk_tokens = cfg.train.loss_chunk_for(vocab_size(model))
    entry = registry.get("method", cfg.method.name)
    torch.manual_seed(cfg.train.seed)
    session = Session(cfg, model, tokenizer, task, train_data, eval_data, None, None, None, device, dist)  # type: ignore[arg-type]
    if m.adapter:  # model.adapter: continue an existing adapter (its method; a resume loads it too)
        start_method = load_start(model, m.adapter)
        check_method(cfg.method, start_method, m.adapter)
        cfg.method, task.from_adapter = start_method, True
        entry = registry.get("method", cfg.method.name)
    elif saved is not None:
        rebuild(model, cfg.method, "default", saved.get("layers") or {}, saved.get("modules_to_save"))
    else:
        batches = (session.batch(i, seed_offset=1) for i in range(cfg.train.calibration_batches))
        session.method_result = entry.apply(model, cfg.method, "default", batches, loss_fn=task.mean_loss)
        apply_trainable_tokens(model, cfg.method, m, tokenizer)  # method.trainable_tokens, any method
    if not m.quantize:
        model.to(device)
    if not any(p.requires_grad for p in model.parameters()):
        if not hasattr(cfg.method, "targets"):  # frozen: only a task head trains
            raise RankwiseError(f"method {cfg.method.name!r} trains only the task head, and a "
                                f"{cfg.task.name} model has none; choose an adapter method such "
                                "as lora")
        raise RankwiseError(f"method {cfg.method.name!r} left nothing trainable; check method.targets")
    for p in model.parameters():  # master weights: a head copied from a bf16 base trains in fp32
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    if cfg.train.gradient_checkpointing:
        enable_checkpointing(model)
    if cfg.train.neftune_noise_alpha:  # noise on the input embeddings of training forwards
        add_neftune(model, cfg.train.neftune_noise_alpha)
    set_fused_lora(model, cfg.train.fused_lora)
    if cfg.data.select.method or cfg.data.select.from_:  # data.select: keep the chosen records
        from rankwise.recipes.select import select_training
        (selected if selected is not None else {}).update(full=train_data, selection=select_training(session))
    task.prepare(model, [session.train_data, eval_data], entry.trains == "full",
                 cfg.train.eval_batch_size, device)  # DPO: a precomputed reference
    if getattr(task, "snapshot", None) is not None and dist.active and dist.kind == "fsdp":
        raise RankwiseError("the reference 'initial' swaps in a copy of the weights, which FSDP2 "
                            "shards; use train.distributed: ddp (or, for DPO, task.reference: precomputed)")
    if cfg.data.packing:
        session.train_data = packed_training_data(model, session.train_data, cfg.data.max_length, device)
    if cfg.train.compile:  # the blocks compiled; a method dynamo cannot trace is refused here
        compile_model(model)
        problem = compile_problem(model, cfg.method.name,
                                  lambda: task.loss_sum(model, session.batch(0))[0].backward())
        if problem:
            raise RankwiseError(problem)
    session.model = model = dist.prepare_model(model)
    session.optimizer = registry.get("optimizer", cfg.optim.name).builder(model, cfg.optim)
    session.scope = optim_scope.check(session.optimizer, cfg.optim.name, cfg.method.name)
    session.scheduler = linear_schedule(session.optimizer, cfg.train.steps, cfg.train.warmup_fraction)
    return session


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


def set_fused_lora(model: nn.Module, setting) -> None:
    """Apply ``train.fused_lora`` to every layer that carries the switch (LoRA's layers)."""
    for layer in model.modules():
        if isinstance(getattr(type(layer), "fused_lora", None), bool):
            layer.fused_lora = setting in ("auto", True)


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
    is_run = (out / "config.yaml").exists()
    resume = _check_run_folder(out, resume, console, write=main)
    if main and (resume or is_run):
        for partial in clean_incomplete(out):  # a kill during checkpoint rotation
            console.print(f"removed the incomplete checkpoint {partial}")
    old_steps = _check_same_config(out, cfg) if resume else None
    ckpts = list_checkpoints(out) if resume else []
    meta = read_meta(ckpts[-1]) if ckpts else None
    rewrite = _check_extension(out, cfg, resume, old_steps, meta)
    dist.barrier()  # every process has checked the folder before rank 0 writes to it
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
    t = cfg.train
    out.mkdir(parents=True, exist_ok=True)
    log = cb.EventLog(out / "events.jsonl", t.log_every) if main else None
    mem = PeakMemory(session.device)  # the steps' peak; evaluations apart (MeasureMemory)
    measure = cb.MeasureMemory(mem)
    callbacks = [
        cb.ProgressBar(cfg.method.name, console, tokens=not session.task.uses_labels,
                       disable=not (t.progress and main)),
        log, cb.Evaluate(session.eval_data, t.eval_batch_size, t.eval_every, log, memory=measure),
    ]
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
    engine = session.engine([c for c in callbacks if c is not None])
    start_step, prior_time = 0, 0.0
    if ckpts:
        _resume(ckpts[-1], meta, session, engine)
        start_step, prior_time = int(meta["step"]), float(meta.get("train_time_s", 0.0))
        measure.restore(meta)  # the peaks of the steps trained before
        console.print(f"resuming {out} from step {start_step}")
        _continue_schedule(session, engine, meta, old_steps, console)
    elif resume:
        console.print(f"no checkpoint in {out}; starting from step 0")
    if session.scope is not None:
        console.print(optim_scope.describe(session.scope, cfg.optim.name), soft_wrap=True)
    if t.offload_activations and engine.offloader is not None and not engine.offloader.active:
        console.print(f"train.offload_activations: no effect on device {session.device} "
                      "(activations already live in CPU memory)", soft_wrap=True)
    if main and folders.read_record(out) is None:
        folders.record(out, "train")
    if main and (old_steps is not None or not (out / "config.yaml").exists()):
        atomic.write_bytes(out / "config.yaml", yamlfile.dump(cfg.to_dict(), sort_keys=False).encode())
    if main and adds_tokens(cfg.model) and not (out / "tokenizer").is_dir():
        save_tokenizer(session.tokenizer, out)  # the extended tokenizer: export and generate use it
    if main and not ckpts and hasattr(session.method_result, "write_artifacts"):
        session.method_result.write_artifacts(out)
    if rewrite:  # a finished run whose adapter/ (model/) is unreadable: write it again, only that
        with dist.guard(), dist.full_params(session.model):
            written = save_result(session, out)
            if main:
                console.print(f"{out} is finished; wrote {written} again from the checkpoint of "
                              f"step {start_step}")
        return json.loads((out / "metrics.json").read_text())
    engine.callbacks.append(measure)
    try:
        with mem, dist.guard():
            state = engine.fit(t.steps, start_step, prior_time)
    except NonFiniteLoss as err:
        last = list_checkpoints(out)
        raise RankwiseError(f"{err} (last good checkpoint: {last[-1] if last else 'none'})") from None
    except KeyboardInterrupt:
        console.print(f"interrupted; checkpoint saved. Continue with --resume --out {out}")
        raise
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
    if main and t.progress and console.is_terminal:  # plan's prediction beside the measurement
        # (docs/plan.md); for a person at a terminal: a meta forward costs ~0.3 s
        from rankwise.recipes.planner import predicted_train_peak_mb
        predicted = predicted_train_peak_mb(cfg, session.device, dist.world)
        if predicted is not None:
            console.print(f"peak memory {metrics['peak_memory_mb']:.1f} MiB ({mem.meter}); rankwise plan "
                          f"predicted {predicted:.1f} MiB for the training steps at data.max_length="
                          f"{cfg.data.max_length} (evaluation is not planned)")
    return metrics
