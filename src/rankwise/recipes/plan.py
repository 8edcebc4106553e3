"""``rankwise plan``: predict the peak memory of a training config before it runs.

The model is built from its ``config.json`` on the meta device (no weights are read), the
method is applied to it through the registry (so trainable parameter counts are exact), and
the peak is composed from parts (see docs/plan.md for every formula):

* **weights**: frozen parameters and buffers at their dtype; quantized linear layers at the
  bitsandbytes formula (NF4/FP4: half a byte per element + block scales, QLoRA's double
  quantization included; int8: one byte + an fp32 scale per row);
* **trainable**: the trainable parameters, float32 master copies (``prepare`` upcasts them);
* **gradients**: one float32 gradient per trainable element (per-layer updates: the largest
  single parameter's);
* **optimizer state**: the optimizer registration's ``state_floats`` formula (4 bytes each;
  8-bit state: 1 byte each + one fp32 absmax per block of 256), plus the 0-dim step counters;
* **activations**: counted, not guessed: one forward of the meta model with
  ``saved_tensors_hooks`` records every tensor autograd saves for backward (views and
  repeats of one storage counted once, parameters excluded), at micro-batch 1 and 2 so that
  the per-example slope and the per-step constant are separate; autocast is emulated on meta
  (matmul-type ops cast to the compute dtype, as ``torch.autocast`` does) and
  ``scaled_dot_product_attention`` counts what the fused kernels save (q, k, v, output and
  the fp32 log-sum-exp). Checkpointing is composed from the per-layer counts: each block keeps
  its input and one block's full set lives again during its recomputation;
* **logits/loss**: the causal-LM loss of :mod:`rankwise.engine.task` keeps the
  ``(B, T, V)`` logits in the compute dtype, a float32 copy and the log-softmax output, and
  backward allocates two float32 ``(N, V)`` gradients (``N = B (T-1)``): ``c B T V + 12 N V``
  at its peak; chunked loss replaces ``B T`` by the chunk;
* **temporaries**: backward's transient buffers: the optimizer step's (the largest parameter
  twice, or every trainable parameter once for the CUDA foreach path) and a dequantized
  weight of the largest quantized layer.

The meter: :mod:`rankwise.memory` measures bytes of live tensors; ``peak_mb`` here is the peak
of all tensors a run holds (weights included), which is what ``bench llm-finetune`` reports as
``held + step peak``. ``metrics.json``'s ``peak_memory_mb`` starts counting after the model is
loaded: compare it with ``train_peak_mb`` (``peak_mb`` minus weights and trainable weights).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from rankwise import registry
from rankwise.errors import RankwiseError
from rankwise.recipes import plan_meta as meta_ops

MiB = 2 ** 20
# Switches built on other branches; plan reads them from the config when the dataclasses
# have them, else it takes them out of the raw config itself (see :func:`split_switches`).
SWITCHES = {("train", "loss_chunk_tokens"): "auto", ("train", "offload_activations"): False,
            ("optim", "per_layer"): False, ("optim", "state_bits"): 32}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class Estimate:
    """A predicted peak, in bytes per part (see the module docstring).

    Attributes:
        weights, trainable, gradients, optimizer_state, activations, logits_loss,
            temporaries: The parts at the peak.
        peak: Their sum: the predicted peak of live tensors.
        tokens_per_step: ``micro_batch * seq * grad_accum`` (* processes: the global step).
        micro_batch, seq, grad_accum: The shape of a step (``micro_batch``: one process's).
        processes, distributed: torchrun's world size and ``train.distributed`` (``None``
            for one process); every part is then one process's.
        trainable_params: Exact trainable element count.
        dominant: The name of the largest part.
    """

    weights: int = 0
    trainable: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    logits_loss: int = 0
    temporaries: int = 0
    tokens_per_step: int = 0
    micro_batch: int = 1
    seq: int = 0
    grad_accum: int = 1
    trainable_params: int = 0
    processes: int = 1
    distributed: str | None = None
    notes: list[str] = field(default_factory=list)

    PARTS = ("weights", "trainable", "gradients", "optimizer_state", "activations",
             "logits_loss", "temporaries")

    @property
    def peak(self) -> int:
        """Sum of the parts."""
        return sum(getattr(self, p) for p in self.PARTS)

    @property
    def dominant(self) -> str:
        """The largest part's name."""
        return max(self.PARTS, key=lambda p: getattr(self, p))

    def to_json(self) -> dict:
        """The ``--json`` object: ``peak_mb`` (MiB, metrics.json's unit), each part in MiB."""
        out = {f"{p}_mb": round(getattr(self, p) / MiB, 2) for p in self.PARTS}
        out.update(peak_mb=round(self.peak / MiB, 2),
                   train_peak_mb=round((self.peak - self.weights - self.trainable) / MiB, 2),
                   tokens_per_step=self.tokens_per_step, micro_batch=self.micro_batch,
                   seq=self.seq, grad_accum=self.grad_accum,
                   trainable_params=self.trainable_params, dominant=self.dominant,
                   processes=self.processes, distributed=self.distributed, notes=self.notes)
        return out


def split_switches(data: dict) -> tuple[dict, dict]:
    """Take the memory switches the config dataclasses do not know yet out of a raw config.

    Returns:
        ``(data without them, {(section, key): value})`` (defaults filled in).
    """
    from rankwise.recipes.config import TrainConfig
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    found = {}
    for (section, key), default in SWITCHES.items():
        part = data.get(section) or {}
        known = section == "train" and key in {f.name for f in dataclasses.fields(TrainConfig)}
        if section == "optim":
            name = str(part.get("name", "adamw"))
            cls = registry.get("optimizer", name).config_cls if name in registry.names("optimizer") else None
            known = cls is not None and key in {f.name for f in dataclasses.fields(cls)}
        found[(section, key)] = part.get(key, default)
        if not known and key in part:
            del part[key]
    return data, found


def check_switches(sw: dict, cfg) -> None:
    """Raise on switch values plan cannot model (one line each, all at once)."""
    problems = []
    chunk = sw[("train", "loss_chunk_tokens")]
    if chunk not in (None, "auto") and (not isinstance(chunk, int) or chunk < 0):
        problems.append(f"train.loss_chunk_tokens: got {chunk!r}; expected auto, 0 or a positive integer")
    if sw[("optim", "state_bits")] not in (None, 8, 32):
        problems.append(f"optim.state_bits: got {sw[('optim', 'state_bits')]!r}; expected 32 or 8")
    if sw[("optim", "per_layer")] and (cfg.train.grad_accum > 1 or cfg.train.grad_clip):
        problems.append("optim.per_layer needs train.grad_accum: 1 and train.grad_clip: 0 "
                        "(each parameter steps as soon as its gradient is ready)")
    if problems:
        raise RankwiseError("; ".join(problems))


# ---------------------------------------------------------------- the meta model

class _NoCalibration:
    """The calibration batches plan hands a method: plan reads no data, so a method whose
    initialisation does read them (GoRA, LoRA's ``eva``/``corda``) stops with one line that
    names the method and a data-free config of the same size to plan instead."""

    def __init__(self, method):
        self.method = method

    def __iter__(self):
        m = self.method
        if hasattr(m, "init"):
            instead = "plan it with the same rank and a data-free init (e.g. --set method.init=kaiming)"
        else:  # GoRA: its ranks come from gradients, their budget is uniform LoRA's at rank r
            instead = (f"plan LoRA at the same rank and targets (method: {{name: lora, r: {m.r}, "
                       f"targets: {m.targets!r}}}: the same parameter budget)")
        raise RankwiseError(f"plan: method {m.name!r} calibrates on data before it trains, and "
                            f"plan reads no data; {instead}, or run it")


def meta_model(cfg) -> nn.Module:
    """The run's model on the meta device with the method applied and trainable weights in
    float32 (as :func:`rankwise.recipes.session.prepare` leaves them). Nothing is read but the
    ``config.json`` (and, for the ``tiny-*`` models, the packaged tokenizer's size).

    Raises:
        RankwiseError: If the folder has no config, or the method refuses the model or needs
            calibration data (the message names the method).
    """
    import transformers

    from rankwise.engine import get_task
    from rankwise.recipes import model as rm
    task = get_task(cfg.task.name)
    auto = getattr(transformers, task.auto_class)
    if cfg.model.path in rm.TINY:
        config = rm._tiny_config(cfg.model.path, len(rm.load_tokenizer(cfg.model.path)),
                                 cfg.model.num_labels or 2)
    else:
        folder = rm.model_folder(cfg.model.path)
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        if cfg.model.train_tokenizer is not None:  # the run sizes the vocabulary to it
            config.vocab_size = cfg.model.train_tokenizer.vocab_size
        if task.uses_labels:
            config.num_labels = cfg.model.num_labels or 2
    config.use_cache = False
    with torch.device("meta"):
        model = auto.from_config(config).to(rm.torch_dtype(cfg.model.dtype))
    try:
        registry.get("method", cfg.method.name).apply(model, cfg.method, "default",
                                                      batches=_NoCalibration(cfg.method))
    except RankwiseError as err:
        text = str(err)
        raise RankwiseError(text if text.startswith("plan:") else
                            f"plan: method {cfg.method.name!r}: {text}") from None
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return model.train()  # dropout saves its masks, as in training


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Base linear layers bitsandbytes would quantize (not the output head, as transformers)."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_names = {n for n, m in model.named_modules() if m is out_emb}
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear
            and not m.weight.requires_grad and n not in head_names
            and not any(n.endswith(s) for s in ("score", "classifier", "lm_head"))}


def quantized_bytes(numel: int, out_features: int, quantize: str, double_quant: bool) -> int:
    """Bytes bitsandbytes keeps for one quantized ``(out, in)`` weight of ``numel`` elements.

    NF4/FP4: ``numel/2`` packed bytes + absmax per block of 64 (fp32; under double quantization
    uint8 codes + fp32 absmax per 256 blocks + a 256-entry fp32 code + an fp32 offset).
    int8: ``numel`` bytes + one fp32 scale per output row.
    """
    if quantize == "int8":
        return numel + 4 * out_features
    blocks = math.ceil(numel / 64)
    scales = blocks + 4 * math.ceil(blocks / 256) + 4 * 256 + 4 if double_quant else 4 * blocks
    return math.ceil(numel / 2) + scales + 4 * 16  # + the 16-entry code of the 4-bit type


def weight_bytes(model: nn.Module, cfg) -> tuple[int, int, int]:
    """``(frozen weight bytes, trainable bytes, largest quantized layer's dequantized bytes)``."""
    q = cfg.model.quantize
    quant = _linear_layers(model) if q else {}
    qids = {id(m.weight) for m in quant.values()}
    frozen = trainable = 0
    for p in {id(p): p for p in model.parameters()}.values():
        if id(p) in qids:
            continue
        if p.requires_grad:
            trainable += p.numel() * p.element_size()
        else:
            frozen += p.numel() * p.element_size()
    frozen += sum(b.numel() * b.element_size() for b in model.buffers())
    c = DTYPE_BYTES[cfg.model.dtype]
    for m in quant.values():
        frozen += quantized_bytes(m.weight.numel(), m.out_features, q, cfg.model.double_quant)
    deq = max((m.weight.numel() * c for m in quant.values()), default=0)
    return frozen, trainable, deq


def optimizer_bytes(model: nn.Module, cfg, state_bits: int) -> int:
    """Optimizer state bytes: the registration's ``state_floats`` at 4 bytes (8-bit: 1 byte +
    fp32 absmax per 256), else two moments per trainable element (AdamW)."""
    entry = registry.get("optimizer", cfg.optim.name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    floats = (entry.state_floats(model, cfg.optim) if entry.state_floats is not None
              else 2 * sum(p.numel() for p in trainable))
    if state_bits == 8 and not getattr(cfg.optim, "state_bits", None):
        return int(floats) + 4 * math.ceil(floats / 256)  # plan's own switch (--fit)
    return int(4 * floats)  # an optimizer configured with state_bits counts its codes itself


@dataclass
class Sharding:
    """What one process holds under FSDP2 (``train.distributed: fsdp``), in bytes.

    :meth:`rankwise.engine.distributed.Distributed.prepare_model` calls ``fully_shard`` on every
    block of every ``nn.ModuleList`` and on the root: each parameter is split on dim 0 into
    ``world`` chunks of ``ceil(rows / world)`` rows (the last padded), buffers stay whole.

    Attributes:
        frozen, trainable: This process's shards (+ every buffer, whole, in ``frozen``).
        trainable_elems: Trainable elements in the shards (gradients and AdamW moments).
        biggest: Elements of the largest trainable shard (the CPU optimizer's temporaries).
        block, block_trainable: The largest block's unsharded parameters (all of them /
            the trainable ones), gathered while it runs.
        root, root_trainable: The same for the root's own parameters (embeddings, final norm,
            head): FSDP2 keeps the root gathered from its forward to the end of the backward.
    """

    frozen: int = 0
    trainable: int = 0
    trainable_elems: int = 0
    biggest: int = 0
    block: int = 0
    block_trainable: int = 0
    root: int = 0
    root_trainable: int = 0


def shard_elems(p: torch.Tensor, world: int) -> int:
    """Elements of one FSDP2 shard of ``p`` (dim 0 split in ``ceil(rows / world)`` rows)."""
    if p.dim() == 0:
        return 1
    rows = p.shape[0]
    return math.ceil(rows / world) * (p.numel() // rows if rows else 0)


def fsdp_sharding(model: nn.Module, world: int) -> Sharding:
    """The per-process bytes of ``model`` under FSDP2 over ``world`` processes."""
    out = Sharding()
    blocks = [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m]
    in_block: set[int] = set()
    for b in blocks:
        full = sum(p.numel() * p.element_size() for p in b.parameters())
        train = sum(p.numel() * p.element_size() for p in b.parameters() if p.requires_grad)
        out.block, out.block_trainable = max(out.block, full), max(out.block_trainable, train)
        in_block.update(id(p) for p in b.parameters())
    for p in {id(p): p for p in model.parameters()}.values():
        n = shard_elems(p, world)
        if p.requires_grad:
            out.trainable += n * p.element_size()
            out.trainable_elems += n
            out.biggest = max(out.biggest, n)
        else:
            out.frozen += n * p.element_size()
        if id(p) not in in_block:
            out.root += p.numel() * p.element_size()
            out.root_trainable += p.numel() * p.element_size() if p.requires_grad else 0
    out.frozen += sum(b.numel() * b.element_size() for b in model.buffers())
    return out


# ---------------------------------------------------------------- counting saved tensors
_MATMULS = {torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
            torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.Tensor.mm, torch.Tensor.bmm}


class _Probe(TorchFunctionMode):
    """Emulates CPU/CUDA autocast on meta tensors (matmul-type ops take ``dtype`` inputs) and
    makes ``scaled_dot_product_attention`` save what the device's kernel saves: the fused
    kernels' q, k, v, output and log-sum-exp; with padded batches (a mask reaches SDPA) on
    CPU the math path (run on meta, so its saved scores are counted), on CUDA the fused
    kernel plus the one ``(B, 1, T, T)`` mask all layers share."""

    def __init__(self, dtype: torch.dtype | None, record, padded: str | None = None) -> None:
        super().__init__()
        self.dtype, self.record, self.padded = dtype, record, padded
        self.mask = None

    def _cast(self, x):
        if self.dtype is not None and isinstance(x, torch.Tensor) and x.dtype == torch.float32:
            return x.to(self.dtype)
        return x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = (self._cast(t) for t in args[:3])
            if self.padded is not None and self.mask is None:
                shape = (q.shape[0], 1, q.shape[-2], k.shape[-2])
                self.mask = torch.zeros(shape, dtype=torch.bool, device=q.device)
            if self.padded == "cpu":
                return func(q, k, v, attn_mask=self.mask, dropout_p=kwargs.get("dropout_p", 0.0),
                            scale=kwargs.get("scale"), enable_gqa=q.shape[1] != k.shape[1])
            if self.mask is not None:
                self.record(self.mask)
            out = q.clone()  # (B, heads, T, d): the output, on the graph of q
            for t in (q, k, v, out):
                self.record(t)
            self.record(torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))  # lse
            return out
        if meta_ops.grouped_mm_needs_stand_in(func, args, kwargs):
            return meta_ops.grouped_mm(func, args, kwargs)
        if func in _MATMULS and self.dtype is not None:
            args = tuple(self._cast(a) for a in args)
            kwargs = {k: self._cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@dataclass
class Saved:
    """Bytes autograd saves in one forward: before the blocks, per block, after them."""

    pre: int = 0
    layers: list[int] = field(default_factory=list)
    post: int = 0
    block_input: int = 0   # one block's input hidden states (what checkpointing keeps)

    @property
    def total(self) -> int:
        return self.pre + sum(self.layers) + self.post


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the longest ``nn.ModuleList`` of the model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len, default=[])


def count_saved(model: nn.Module, batch: int, seq: int, compute: torch.dtype | None,
                padded: str | None = None, method: str | None = None) -> Saved:
    """Run one meta forward of ``batch x seq`` tokens and count the bytes autograd saves.

    Args:
        model: A meta model (from :func:`meta_model`).
        batch, seq: The micro-batch shape.
        compute: The autocast dtype (``None``: no autocast).
        padded: ``"cpu"`` / ``"cuda"`` when batches carry padding (the attention gets a mask,
            which changes the kernel; see :class:`_Probe`), ``None`` for full rows.
        method: The method's name, for the error message.

    Returns:
        The counts by region.
    """
    import transformers.masking_utils as masking
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: set[int] = set()
    keep: list[torch.Tensor] = []  # alive until the count ends, so no storage address is reused
    out = Saved()
    where = ["pre"]
    blocks = list(_blocks(model))

    def record(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key in params or key in seen or t.device.type != "meta":
            return t
        seen.add(key)
        keep.append(t)
        n = t.untyped_storage().nbytes()
        if where[0] == "pre":
            out.pre += n
        elif where[0] == "post":
            out.post += n
        else:
            out.layers[where[0]] += n
        return t

    def enter(i):
        def hook(module, args, kwargs):
            where[0] = i
            if i == 0:
                x = args[0] if args else kwargs.get("hidden_states")
                out.block_input = x.numel() * x.element_size()
        return hook

    def leave(i):
        def hook(module, args, result):
            where[0] = "post" if i == len(blocks) - 1 else i + 1
        return hook

    out.layers = [0] * len(blocks)
    handles = [b.register_forward_pre_hook(enter(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(leave(i)) for i, b in enumerate(blocks)]
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    try:
        # The counted batch is full rows, so any mask built from it (prompt methods prepend
        # their virtual tokens' ones) is all ones: say so where transformers would read it.
        with mock.patch.object(masking, "find_packed_sequence_indices", lambda *a, **k: None), \
                mock.patch.object(masking, "fast_all", meta_ops.all_ones(masking.fast_all)), \
                torch.autograd.graph.saved_tensors_hooks(record, lambda t: t), \
                _Probe(compute, record, padded):
            model(input_ids=ids)
    except (RuntimeError, NotImplementedError) as err:
        with_method = f" with method {method!r}" if method else ""
        raise RankwiseError(f"plan: the model's forward{with_method} does not run on the meta device "
                            f"({str(err).splitlines()[0]}); plan supports transformers models "
                            "whose forward has no data-dependent branch") from None
    finally:
        for h in handles:
            h.remove()
    return out


__all__ = ["Estimate", "Saved", "SWITCHES", "Sharding", "check_switches", "count_saved",
           "fsdp_sharding", "meta_model", "optimizer_bytes", "quantized_bytes", "shard_elems",
           "split_switches", "weight_bytes"]
