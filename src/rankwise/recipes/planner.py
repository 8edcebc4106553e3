"""Compose the peak of a training step from :mod:`rankwise.recipes.plan`'s counts, search the
cheapest switches that fit a budget (``plan --fit``), and print the result.

The step of :class:`rankwise.engine.Engine` has two candidate peaks (docs/plan.md derives both):

* **backward start** - every saved activation is alive, the loss has its float32 gradients,
  and (with accumulation) the gradients of earlier micro-batches and the previous
  micro-batch's logits; plus a dequantized 4-bit weight (bitsandbytes dequantizes one layer
  at a time in forward and backward);
* **optimizer step** - every gradient, the last micro-batch's logits (the engine still holds
  the model output) and the step's temporaries.

The peak is the larger, on top of the weights, the trainable weights and the optimizer state.
"""
from __future__ import annotations

import dataclasses
import itertools
import re

import torch

from rankwise.errors import RankwiseError
from rankwise.recipes import plan as P

UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "kib": 2 ** 10,
         "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30,
         "t": 2 ** 40}


def parse_size(text: str) -> int:
    """``"24GiB"`` -> bytes (GB = 10^9, GiB and a bare G = 2^30, B = bytes).

    Raises:
        RankwiseError: If ``text`` is not a size, or is a number without a unit (``8`` would
            be 8 bytes, which nobody means).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m and not m.group(2):
        n = m.group(1)
        raise RankwiseError(f"--memory: got {text!r} without a unit; write {n}GiB (2^30 bytes), "
                            f"{n}GB (10^9 bytes) or {n}MiB")
    unit = (m.group(2) or "b").lower() if m else ""
    if not m or unit not in UNITS or float(m.group(1)) <= 0:
        raise RankwiseError(f"--memory: got {text!r}; expected a size such as 24GiB, 80GB or 16000MiB")
    return int(float(m.group(1)) * UNITS[unit])


class Planner:
    """Predicts a config's peak; caches the meta model and its saved-tensor counts.

    Args:
        cfg: The validated run config.
        switches: ``{(section, key): value}`` from :func:`rankwise.recipes.plan.split_switches`.
        device: ``cpu`` or ``cuda`` (the CUDA optimizer step runs torch's foreach path).
        padded: Batches carry padding (variable-length data without packing): the attention
            then gets a mask (default: full rows, as packed or uniform-length data).
        nproc: torchrun's processes (``--nproc-per-node`` x nodes); above 1 the prediction is
            one process's peak under ``train.distributed`` (``ddp``: the whole model, a share
            of the batch; ``fsdp``: FSDP2 shards, see :meth:`estimate`).
    """

    def __init__(self, cfg, switches: dict, device: str = "cpu", padded: bool = False,
                 nproc: int = 1) -> None:
        if not isinstance(nproc, int) or nproc < 1:
            raise RankwiseError(f"--nproc: got {nproc!r}; expected the number of processes (>= 1)")
        self.cfg, self.device, self.nproc = cfg, device, nproc
        self.padded = ("cuda" if device.startswith("cuda") else "cpu") if padded else None
        self._models: dict = {}
        self._saved: dict = {}
        self.switches = self._resolved(dict(switches))

    def _resolved(self, sw: dict) -> dict:
        """The switches as the run resolves them: ``state_bits`` unset is 32-bit state, and
        ``loss_chunk_tokens: auto`` is the train config's choice for this model's vocabulary
        (``None``: unchunked)."""
        bits = ("optim", "state_bits")
        sw[bits] = sw.get(bits) or 32
        chunk = ("train", "loss_chunk_tokens")
        if sw.get(chunk) == "auto":
            vocab = 0 if self._uses_labels(self.cfg) else \
                getattr(self._model(self.cfg)[0].config, "vocab_size", 0)
            sw[chunk] = dataclasses.replace(self.cfg.train, loss_chunk_tokens="auto").loss_chunk_for(vocab)
        sw[chunk] = sw.get(chunk) or None
        return sw

    # -- pieces ---------------------------------------------------------------------------
    def _model(self, cfg):
        key = (cfg.model.dtype, cfg.model.quantize, cfg.model.double_quant)
        if key not in self._models:
            model = P.meta_model(cfg)
            frozen, trainable, deq = P.weight_bytes(model, cfg)
            self._models[key] = (model, frozen, trainable, deq)
        return self._models[key]

    def _compute(self, cfg) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)

    def saved(self, cfg, micro: int) -> P.Saved:
        """Saved-tensor counts at ``micro`` examples, linear in it (probed at 1 and 2)."""
        seq = cfg.data.max_length
        key = (cfg.model.dtype, cfg.train.precision, seq)
        if key not in self._saved:
            model = self._model(cfg)[0]
            self._saved[key] = [P.count_saved(model, b, seq, self._compute(cfg), self.padded,
                                              cfg.method.name) for b in (1, 2)]
        one, two = self._saved[key]

        def at(a: int, b: int) -> int:
            return a + (b - a) * (micro - 1)
        return P.Saved(pre=at(one.pre, two.pre), post=at(one.post, two.post),
                       layers=[at(a, b) for a, b in zip(one.layers, two.layers)],
                       block_input=at(one.block_input, two.block_input))

    # -- the estimate ---------------------------------------------------------------------
    def estimate(self, cfg=None, switches: dict | None = None) -> P.Estimate:
        """The predicted peak of ``cfg`` (default: the planner's) under ``switches``."""
        cfg = cfg or self.cfg
        sw = {**self.switches, **(switches or {})}
        P.check_switches(sw, cfg)
        model, frozen, trainable_bytes, deq = self._model(cfg)
        t = cfg.train
        world = self.nproc
        kind = t.distributed if world > 1 else None
        self._check_processes(cfg, sw, world, kind)
        accum, seq = t.grad_accum, cfg.data.max_length
        # this process's share of the global batch (rank 0 takes the larger share), per micro-batch
        micro = _ceil(_ceil(t.batch_size, world), accum)
        est = P.Estimate(weights=frozen, trainable=trainable_bytes, micro_batch=micro, seq=seq,
                         grad_accum=accum, tokens_per_step=t.batch_size * seq, processes=world,
                         distributed=kind)
        grads, biggest, gathered, reduce = self._shards(model, cfg, sw, est, world, kind)
        if sw[("optim", "per_layer")]:
            grads = biggest
        s, acts = self._activations(cfg, sw, micro, est)
        held, loss, head_grad = self._loss_bytes(model, cfg, sw, micro * max(seq - 1, 1))
        step_tmp = grads if self.device.startswith("cuda") and not sw[("optim", "per_layer")] else 2 * biggest
        if sw[("optim", "per_layer")]:
            step_tmp = 2 * biggest
        if kind == "ddp":  # sync_grads: every gradient and their flat all-reduce buffer at once
            step_tmp = max(step_tmp, grads)
        if kind == "fsdp":
            head_grad = 0  # counted in the root's unsharded gradients
        earlier = (grads + held) if accum > 1 else head_grad
        backward = acts + loss + earlier + deq + gathered
        if reduce:  # FSDP2: the last block's reduce-scatter, its activations and the loss's freed
            acts_left = max(0, acts - max(s.layers, default=0))
            if acts_left + earlier + deq + gathered + reduce > backward:
                acts, loss, deq = acts_left, 0, deq + reduce
                backward = acts + earlier + deq + gathered
        step = grads + held + step_tmp
        if backward >= step:
            est.activations, est.logits_loss = acts, loss + (held if accum > 1 else 0)
            est.gradients = grads if accum > 1 else head_grad
            est.temporaries = deq + gathered
            if grads > est.gradients:  # a "gradients 0.0 MiB" line needs its reason
                est.notes.append(
                    f"gradients {est.gradients / P.MiB:,.1f} MiB: the peak is the start of backward, "
                    f"before the {grads / P.MiB:,.1f} MiB of gradients exist; the optimizer step "
                    f"holds them and peaks lower, at {(est.peak - backward + step) / P.MiB:,.1f} MiB")
        else:
            est.logits_loss, est.gradients, est.temporaries = held, grads, step_tmp
        return est

    def _shards(self, model, cfg, sw: dict, est: P.Estimate, world: int, kind: str | None) -> tuple:
        """Optimizer state and this process's shares; ``(grads, biggest, gathered, reduce)`` bytes."""
        params = [p for p in model.parameters() if p.requires_grad]
        est.trainable_params = sum(p.numel() for p in params)
        grads = 4 * est.trainable_params
        biggest = 4 * max((p.numel() for p in params), default=0)
        state = P.optimizer_bytes(model, cfg, sw[("optim", "state_bits")])
        # 0-dim step counters of torch's AdamW (one per parameter with state)
        counters = 4 * len(params) if cfg.optim.name == "adamw" else 0
        est.optimizer_state = state + counters
        gathered = reduce = 0  # FSDP2: gathered parameters; a block's gradient reduce-scatter
        if kind == "fsdp":
            sh = P.fsdp_sharding(model, world)
            est.weights, est.trainable = sh.frozen, sh.trainable
            est.optimizer_state = int(state * sh.trainable_elems / max(est.trainable_params, 1)) + counters
            grads, biggest = 4 * sh.trainable_elems, 4 * sh.biggest
            # The root stays gathered (with its unsharded gradients) from its forward to the end
            # of the backward; in the backward a block is gathered while the next one is
            # prefetched. When a block's backward ends, its gradients are copied into the
            # reduce-scatter input, the shard output is allocated, and gloo reduces a copy of
            # the input (NCCL does not copy).
            gathered = sh.root + sh.root_trainable + 2 * sh.block
            copy = 0 if self.device.startswith("cuda") else sh.block_trainable
            reduce = sh.block_trainable + -(-sh.block_trainable // world) + copy
            est.notes.append(f"one of {world} FSDP2 processes: shards of every parameter, "
                             "the root and two blocks gathered at a time")
        elif kind == "ddp":
            est.notes.append(f"one of {world} processes (ddp): the whole model, "
                             f"{est.micro_batch} of the global batch's {cfg.train.batch_size} examples "
                             "per micro-batch")
        return grads, biggest, gathered, reduce

    def _activations(self, cfg, sw: dict, micro: int, est: P.Estimate) -> tuple:
        """The saved activations at the start of backward; ``(saved, bytes)``."""
        s = self.saved(cfg, micro)
        if sw[("train", "offload_activations")]:
            acts = s.pre + max(s.layers, default=0) + s.post
            est.notes.append("offloaded activations counted on the host, not here")
        elif cfg.train.gradient_checkpointing:
            acts = s.pre + len(s.layers) * s.block_input + max(s.layers, default=0) + s.post
        else:
            acts = s.total
        return s, acts

    def _loss_bytes(self, model, cfg, sw: dict, n: int) -> tuple:
        """Logits and loss of ``n`` predicted tokens (causal LM); ``(held, loss, head_grad)`` bytes."""
        # a classifier's logits are negligible
        vocab = getattr(model.config, "vocab_size", 0) if not self._uses_labels(cfg) else 0
        c = 2 if self._compute(cfg) is not None or cfg.model.dtype != "float32" else 4
        chunk = sw[("train", "loss_chunk_tokens")]
        if chunk:
            held, loss = 0, (c + 12) * min(chunk, n) * vocab
        else:  # the engine drops the model's output (the logits) before backward: only the
            held, loss = 0, 12 * n * vocab  # loss's fp32 buffers are alive when the peak comes
        head_grad = 0  # a trainable output head's gradient arrives first in backward (unsharded)
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if out is not None and out.weight.requires_grad:
            head_grad = 4 * out.weight.numel()
        return held, loss, head_grad

    def _check_processes(self, cfg, sw: dict, world: int, kind: str | None) -> None:
        """Refuse what the run itself refuses under ``world`` processes (one line)."""
        if world == 1:
            return
        from rankwise.engine.distributed import Distributed
        problem = Distributed(world=world, kind=kind).problem(cfg.train.batch_size,
                                                               cfg.train.grad_accum, cfg.optim.name)
        if problem is None and sw[("optim", "per_layer")]:
            problem = ("optim.per_layer would step before the gradients are summed across "
                       "processes; set optim.per_layer: false or plan one process (--nproc 1)")
        if problem is None and kind == "fsdp" and sw[("optim", "state_bits")] == 8:
            from rankwise.recipes.session import FSDP_STATE_BITS
            problem = FSDP_STATE_BITS
        if problem is None and kind == "fsdp" and cfg.model.quantize:
            problem = ("plan: train.distributed fsdp with a quantized base (model.quantize) is not "
                       "modelled; plan it with train.distributed: ddp")
        if problem:
            raise RankwiseError(problem)

    def _uses_labels(self, cfg) -> bool:
        from rankwise import registry
        return registry.get("task", cfg.task.name).builder().uses_labels

    # -- --fit ----------------------------------------------------------------------------
    def fit(self, budget: int) -> tuple[list[str], P.Estimate] | None:
        """The cheapest switches (as ``--set`` flags) whose predicted peak fits ``budget``.

        Costs (lower first): loss chunking 1, halving the micro-batch 4 each (accumulation
        keeps tokens per step), 8-bit state 6, per-layer updates 8, checkpointing 10 (a second
        forward), offloading 15, a 4-bit base 25 (changes the base's numerics). Returns
        ``None`` when nothing fits; then :meth:`smallest` says what is reachable.
        """
        best = None
        for flags, cfg, sw, cost in self._candidates():
            est = self.estimate(cfg, sw)
            if est.peak <= budget and (best is None or (cost, est.peak) < (best[0], best[2].peak)):
                best = (cost, flags, est)
        return (best[1], best[2]) if best else None

    def smallest(self) -> P.Estimate:
        """The smallest predicted peak any combination reaches."""
        return min((self.estimate(cfg, sw) for _, cfg, sw, _ in self._candidates()), key=lambda e: e.peak)

    def _candidates(self):
        from rankwise import registry
        base, t = self.cfg, self.cfg.train
        full = registry.get("method", base.method.name).trains == "full"
        causal = not self._uses_labels(base)
        share = _ceil(t.batch_size, self.nproc)  # this process's examples per step
        micros = [m for m in range(1, share // t.grad_accum + 1)
                  if share % m == 0 and m <= share // t.grad_accum]
        fsdp = self.nproc > 1 and t.distributed == "fsdp"
        quant = [False] if full or base.model.quantize or fsdp else [False, True]
        for chunk, micro, bits8, per_layer, ckpt, offload, q in itertools.product(
                [False, True] if causal else [False], sorted(micros, reverse=True),
                [False] if fsdp else [False, True],
                [False, True] if full and self.nproc == 1 else [False], [False, True], [False, True], quant):
            accum = share // micro
            if per_layer and (accum > 1 or t.grad_clip):
                continue  # refused by the per-layer step: the user must drop clipping first
            if offload and ckpt:
                continue  # offloading replaces checkpointing; the pair is never cheaper
            flags, cost = [], 0
            cfg = _copy(base)
            sw = dict(self.switches)
            if chunk and not self.switches[("train", "loss_chunk_tokens")]:
                sw[("train", "loss_chunk_tokens")] = 1024
                flags.append("train.loss_chunk_tokens=1024")
                cost += 1
            if accum != t.grad_accum:
                cfg.train.grad_accum = accum
                flags.append(f"train.grad_accum={accum}")
                cost += 4 * max(0, (share // t.grad_accum // micro).bit_length() - 1)
            if bits8 and sw[("optim", "state_bits")] != 8:
                sw[("optim", "state_bits")] = 8
                flags.append("optim.state_bits=8")
                cost += 6
            if per_layer and not sw[("optim", "per_layer")]:
                sw[("optim", "per_layer")] = True
                flags.append("optim.per_layer=true")
                cost += 8
            if ckpt and not t.gradient_checkpointing:
                cfg.train.gradient_checkpointing = True
                flags.append("train.gradient_checkpointing=true")
                cost += 10
            if offload and not sw[("train", "offload_activations")]:
                sw[("train", "offload_activations")] = True
                flags.append("train.offload_activations=true")
                cost += 15
            if q:
                cfg.model.quantize = "nf4"
                flags.append("model.quantize=nf4")
                if cfg.model.dtype == "float32":
                    cfg.model.dtype, cfg.train.precision = "bfloat16", "bf16"
                    flags += ["model.dtype=bfloat16", "train.precision=bf16"]
                cost += 25
            yield flags, cfg, sw, cost


def plan(path, sets: list[str], memory: str | None = None, device: str = "cpu",
         fit: bool = False, padded: bool = False, nproc: int = 1) -> tuple[dict, str, int]:
    """What ``rankwise plan`` prints: ``(json object, text, exit code)``; with ``nproc`` > 1,
    one process's peak under torchrun with ``train.distributed``.

    Raises:
        RankwiseError: On a bad config, ``--memory`` that is not a size, ``--fit`` without
            ``--memory``, or a budget no combination fits (the smallest reachable peak and
            what dominates it).
    """
    from rankwise.recipes.config import apply_sets, build_run_config, read_yaml
    budget = parse_size(memory) if memory is not None else None
    if fit and budget is None:
        raise RankwiseError("plan --fit needs a budget: add --memory, e.g. --memory 24GiB")
    data, switches = P.split_switches(apply_sets(read_yaml(path), list(sets)))
    cfg = build_run_config(data)
    planner = Planner(cfg, switches, device, padded, nproc)
    est = planner.estimate()
    obj = {**est.to_json(), "device": device, "memory_meter": meter(device)}
    text = render(est, budget)
    if budget is not None:
        obj["budget_mb"] = round(budget / P.MiB, 2)
        obj["fits"] = est.peak <= budget
    if fit:
        found = planner.fit(budget)
        if found is None:
            low = planner.smallest()
            raise RankwiseError(
                f"no combination fits {budget / 2 ** 30:.2f} GiB: the smallest reachable peak is "
                f"{low.peak / 2 ** 30:.2f} GiB, dominated by {low.dominant.replace('_', ' ')} "
                f"({getattr(low, low.dominant) / 2 ** 30:.2f} GiB)")
        flags, best = found
        obj["fit"] = {"set": flags, **best.to_json()}
        paste = " ".join(f"--set {f}" for f in flags) or "(nothing to change: it fits as it is)"
        text += f"\n\n--fit: {paste}\n" + render(best, budget)
    return obj, text, 0


def predicted_train_peak_mb(cfg, device: str, nproc: int = 1) -> float | None:
    """Plan's prediction of ``metrics.json``'s ``peak_memory_mb`` for a run (the peak above the
    loaded model, at ``data.max_length``; one process's under torchrun with ``nproc``
    processes), or ``None`` where plan cannot model the run (a calibrating method, a model
    whose forward does not run on meta)."""
    sw = {k: getattr(getattr(cfg, k[0]), k[1], v) for k, v in P.SWITCHES.items()}
    try:
        est = Planner(cfg, sw, device, nproc=nproc).estimate()
    except (RankwiseError, RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None
    return (est.peak - est.weights - est.trainable) / P.MiB


def meter(device: str) -> str:
    """The memory meter the prediction is compared with on ``device``."""
    from rankwise.memory import meter_name
    return meter_name(device)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _copy(cfg):
    """A copy of the config sections ``--fit`` changes."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model),
                               train=dataclasses.replace(cfg.train))


def render(est: P.Estimate, budget: int | None = None) -> str:
    """The human-readable breakdown."""
    labels = {"weights": "weights (frozen)", "trainable": "trainable weights (fp32)",
              "gradients": "gradients", "optimizer_state": "optimizer state",
              "activations": "activations", "logits_loss": "logits / loss",
              "temporaries": "temporaries"}
    lines = [f"{labels[p]:26s} {getattr(est, p) / P.MiB:12,.1f} MiB" for p in est.PARTS]
    lines.append(f"{'predicted peak':26s} {est.peak / P.MiB:12,.1f} MiB ({est.peak / 2 ** 30:.2f} GiB)")
    per = (f" x {est.processes} processes ({est.distributed}); every part above is one process's"
           if est.processes > 1 else "")
    lines.append(f"tokens per step {est.tokens_per_step:,} (micro-batch {est.micro_batch} x "
                 f"sequence {est.seq} x accumulation {est.grad_accum}{per}); trainable parameters "
                 f"{est.trainable_params:,}")
    if budget is not None:
        verdict = "fits" if est.peak <= budget else "does not fit"
        lines.append(f"{verdict} in {budget / 2 ** 30:.2f} GiB")
    return "\n".join(lines + [f"note: {n}" for n in est.notes])


__all__ = ["Planner", "parse_size", "plan", "predicted_train_peak_mb", "render"]
