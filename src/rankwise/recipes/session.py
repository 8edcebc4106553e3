"""The pieces of a training run, built from a config: :class:`Session` and :func:`prepare`.

:func:`prepare` loads the tokenizer, the data and the base model (:func:`_load`), puts the
method on it (:func:`_apply_method`: afresh, from a checkpoint's structure, or continuing an
adapter) and readies what the steps need around it (:func:`_ready_for_training`: checkpointing,
data selection, the task's own preparation, packing, compilation, the distributed wrapper, the
optimizer and its schedule). ``rankwise train`` (:mod:`rankwise.recipes.train`), the federated
clients, ``select``, ``transfer`` and the benchmarks all start from a :class:`Session`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise import registry
from rankwise.core import shared_inputs
from rankwise.core.io import rebuild
from rankwise.data.packing import packed_training_data
from rankwise.data.text import TextData, build_data
from rankwise.engine import Engine, Task, get_task, linear_schedule
from rankwise.engine.chunked_loss import vocab_size
from rankwise.engine.buckets import bucket_lengths, pad_to_bucket
from rankwise.engine.compile import AutoCompile, compile_model, compile_problem
from rankwise.engine.distributed import Distributed
from rankwise.engine.loop import draw_batches
from rankwise.engine.neftune import add_neftune
from rankwise.engine.precision import precision_problem
from rankwise.errors import RankwiseError
from rankwise.recipes import optim_scope
from rankwise.recipes.config import RunConfig
from rankwise.recipes.export import load_run
from rankwise.recipes.model import enable_checkpointing, load_model, load_tokenizer
from rankwise.recipes.start import check_method, load_start
from rankwise.recipes.teacher import load_teacher
from rankwise.recipes.tokens import apply_trainable_tokens


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

    def schedule(self) -> Any:
        """The step schedule: the chosen order's (``data.order: gain-rl``: GRPO's sampler, built
        once by the task), else the chosen ``data.schedule``'s for this process (``None``: draw
        order). Both are registry entries (:mod:`rankwise.engine.schedules`)."""
        d, dist = self.cfg.data, self.dist
        order = registry.get("order", d.order.name)
        own = order.builder(d.order, self.task, self.cfg, self.model, self.train_data, self.device,
                            dist.active)
        if own is not None:
            return own
        return registry.get("schedule", d.schedule.name).builder(
            d.schedule, self.model, dist.world, dist.rank, self.cfg.train.grad_accum)

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
        ``grad_accum``, ``grad_clip``, ``precision``, ``offload_activations``, ``per_layer``
        (``optim.per_layer``) and ``buckets`` (``train.compile: true``'s length buckets) as
        keyword arguments.
    """
    t = cfg.train
    return {"grad_accum": t.grad_accum, "grad_clip": t.grad_clip, "precision": t.precision,
            "offload_activations": t.offload_activations,
            "per_layer": getattr(cfg.optim, "per_layer", False),
            "buckets": compile_buckets(cfg) if t.compile is True else ()}


def compile_buckets(cfg: RunConfig) -> tuple[int, ...]:
    """The lengths batches are padded to under ``train.compile`` (``train.compile_buckets`` for
    data cut at ``data.max_length``)."""
    return bucket_lengths(cfg.train.compile_buckets, cfg.data.max_length)


def auto_compile(session: Session, say) -> AutoCompile | None:
    """The :class:`AutoCompile` callback of ``train.compile: auto`` (``None`` otherwise; with
    ``gradient_checkpointing``, which compilation does not support yet, it says so instead).

    Args:
        session: The prepared session.
        say: Prints one console line.

    Returns:
        The callback, or ``None``.
    """
    t = session.cfg.train
    if t.compile != "auto":
        return None
    if t.gradient_checkpointing:
        say("train.compile auto: eager (train.gradient_checkpointing is on, which compilation "
            "does not support yet)")
        return None
    buckets, task, pad_id = compile_buckets(session.cfg), session.task, session.train_data.pad_id

    def probe(model: nn.Module) -> None:  # one forward and backward of step 0's padded batch
        task.loss_sum(model, pad_to_bucket(session.batch(0), buckets, pad_id))[0].backward()

    return AutoCompile(buckets, t.AUTO_COMPILE_STEPS, t.AUTO_COMPILE_SAVING, t.AUTO_COMPILE_GRAPH_S,
                       say, probe, session.cfg.method.name)


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
    task.teacher_loader = lambda path, dev, dtype: load_teacher(path, dev, dtype, seed=cfg.train.seed,
                                                                what="task.teacher")  # (gkd's teacher)
    task.run_loader = _run_loader  # a finished run's model (GRPO's reward model)
    session = _load(cfg, task, device, dist, model, tokenizer)
    entry = _apply_method(session, saved)
    _ready_for_training(session, entry, selected)
    return session


def _run_loader(run_dir: str, device: str) -> tuple[Any, nn.Module, Any]:
    """``(config, model, tokenizer)`` of the finished run ``run_dir``, the model on ``device`` in
    eval mode (:attr:`~rankwise.engine.task.Task.run_loader`)."""
    cfg, model, tok = load_run(Path(run_dir))
    if not cfg.model.quantize:  # a quantized base was loaded where it computes
        model.to(device)
    return cfg, model.eval(), tok


def _load(cfg: RunConfig, task: Task, device: str, dist: Distributed, model, tokenizer) -> Session:
    """The tokenizer, the data and the base model on ``device``: a session without a method,
    an optimizer or a schedule yet."""
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
    return Session(cfg, model, tokenizer, task, train_data, eval_data, None, None, None, device, dist)  # type: ignore[arg-type]


def _apply_method(session: Session, saved: dict | None) -> registry.Entry:
    """Put the method on the model: continue ``model.adapter``, rebuild a checkpoint's
    structure (``saved``), or apply it afresh (calibration batches drawn with ``seed + 1``);
    master weights in float32. Returns the method's registry entry."""
    cfg, model, task, m = session.cfg, session.model, session.task, session.cfg.model
    entry = registry.get("method", cfg.method.name)
    torch.manual_seed(cfg.train.seed)
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
        apply_trainable_tokens(model, cfg.method, m, session.tokenizer)  # method.trainable_tokens, any method
    if not m.quantize:
        model.to(session.device)
    if not any(p.requires_grad for p in model.parameters()):
        if not hasattr(cfg.method, "targets"):  # frozen: only a task head trains
            raise RankwiseError(f"method {cfg.method.name!r} trains only the task head, and a "
                                f"{cfg.task.name} model has none; choose an adapter method such "
                                "as lora")
        raise RankwiseError(f"method {cfg.method.name!r} left nothing trainable; check method.targets")
    for p in model.parameters():  # master weights: a head copied from a bf16 base trains in fp32
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return entry


def _ready_for_training(session: Session, entry: registry.Entry, selected: dict | None) -> None:
    """What the steps need around the method: checkpointing, NEFTune, the fused LoRA switch,
    ``data.select``, the task's own preparation (DPO's reference), packing, compilation, the
    distributed wrapper, then the optimizer and its schedule."""
    cfg, model, task, device = session.cfg, session.model, session.task, session.device
    if cfg.train.gradient_checkpointing:
        enable_checkpointing(model)
    if cfg.train.neftune_noise_alpha:  # noise on the input embeddings of training forwards
        add_neftune(model, cfg.train.neftune_noise_alpha)
    set_fused_lora(model, cfg.train.fused_lora)
    if cfg.data.select is not None:  # data.select: keep the chosen records (or reuse those of from)
        from rankwise.recipes.select import select_training
        (selected if selected is not None else {}).update(full=session.train_data,
                                                          selection=select_training(session))
    task.prepare(model, [session.train_data, session.eval_data], entry.trains == "full",
                 cfg.train.eval_batch_size, device)  # DPO: a precomputed reference
    if getattr(task, "snapshot", None) is not None and session.dist.active and session.dist.kind == "fsdp":
        raise RankwiseError("the reference 'initial' swaps in a copy of the weights, which FSDP2 "
                            "shards; use train.distributed: ddp (or, for DPO, task.reference: precomputed)")
    if cfg.data.packing:
        session.train_data = packed_training_data(model, session.train_data, cfg.data.max_length, device)
    if cfg.train.compile is True:  # the blocks compiled; a method dynamo cannot trace is refused here
        buckets = compile_buckets(cfg)
        compile_model(model, buckets=buckets)
        probe = pad_to_bucket(session.batch(0), buckets, session.train_data.pad_id)
        problem = compile_problem(model, cfg.method.name, lambda: task.loss_sum(model, probe)[0].backward())
        if problem:
            raise RankwiseError(problem)
    session.model = model = session.dist.prepare_model(model)
    session.optimizer = registry.get("optimizer", cfg.optim.name).builder(model, cfg.optim)
    session.scope = optim_scope.check(session.optimizer, cfg.optim.name, cfg.method.name)
    session.scheduler = linear_schedule(session.optimizer, cfg.train.steps, cfg.train.warmup_fraction)


def set_fused_lora(model: nn.Module, setting) -> list[tuple[str, ...]]:
    """Apply ``train.fused_lora`` to every layer that carries the switch (LoRA's layers), and
    (``auto``, ``unshared``) call each such class's ``fuse_model(model, on)`` when it has one
    (LoRA's gives every gated MLP its fused node; ``off`` takes it away), so this layer knows
    no method family.

    ``auto`` (or ``True``) also fixes, before any step, which of them read one input and share
    one down-projection product (:func:`rankwise.core.shared_inputs.fix_groups`: one probe
    forward), so a fresh run, a resumed one and a rebuilt federated client compute the same
    products from their first micro-batch; ``unshared`` and ``off`` drop such groups.

    Args:
        model: The adapted model, before any distributed wrapper.
        setting: ``"auto"``, ``"unshared"``, ``"off"``, ``True`` or ``False``.

    Returns:
        The groups that share a product, as module paths (leader first).
    """
    layers = [m for m in model.modules() if isinstance(getattr(type(m), "fused_lora", None), bool)]
    on = setting in ("auto", "unshared", True)
    for layer in layers:
        layer.fused_lora = on
    for cls in dict.fromkeys(type(layer) for layer in layers):
        fuse = getattr(cls, "fuse_model", None)
        if callable(fuse):
            fuse(model, on)
    if setting in ("auto", True):
        return shared_inputs.fix_groups(model, layers)
    shared_inputs.forget(layers)
    return []
