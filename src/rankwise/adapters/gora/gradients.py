"""Step 1 of GoRA: average the loss gradient of each target weight over calibration batches.

Two ways to get ``G = dL/dW`` of a target layer, chosen per target:

* a weight stored as a float parameter: only the target weights require grad; a
  post-accumulate hook on each adds its ``.grad`` into an fp32 accumulator and frees the
  ``.grad`` at once, so besides the accumulators at most one transient full-size gradient is
  alive per backward step, instead of a ``.grad`` for every trainable parameter;
* a quantized layer (bitsandbytes 4-bit/8-bit, whose packed weight cannot hold a gradient):
  ``G = sum over tokens of dL/dy ⊗ x``, from the layer's input ``x`` (kept by a forward hook)
  and its output gradient ``dL/dy`` (a hook on the output tensor), added into the accumulator
  with one ``addmm_``. No layer is dequantized for this except transiently inside
  bitsandbytes' own backward, one layer at a time; nothing requires grad but the layer
  outputs (each output that does not already carry a graph becomes a leaf that does).

The accumulators (one fp32 ``(out, in)`` matrix per target) are what GoRA needs: importance and
B's initialisation read the full averaged G.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from rankwise.core import weights as layer_weights
from rankwise.core.inject import is_conv1d
from rankwise.errors import RankwiseError
from rankwise.memory import PeakMemory


@dataclass
class GradStats:
    """What :func:`accumulate_gradients` measured.

    Attributes:
        grads: ``{path: averaged gradient}`` in the weight's storage layout (fp32).
        batches: How many batches were used.
        early_stopped: Whether the importance test stopped before the last batch.
        history: Importances after each batch (``[{path: I}]``), for the stopping rule.
        accumulator_bytes: Bytes held by the accumulators.
        peak_grad_bytes: Largest sum of live ``.grad`` bytes seen on target weights at a hook
            (0 for targets read through activations: they never get a ``.grad``).
        all_grads_bytes: Bytes a plain ``backward()`` over every trainable parameter would keep
            in ``.grad`` (what the hooks avoid).
        peak_bytes: Peak memory the phase added, by the shared meter (:mod:`rankwise.memory`).
        memory_meter: Which meter measured ``peak_bytes``.
        via_activations: Targets whose gradient came from activations (quantized layers).
    """

    grads: dict[str, torch.Tensor]
    batches: int = 0
    early_stopped: bool = False
    history: list[dict[str, float]] = field(default_factory=list)
    accumulator_bytes: int = 0
    peak_grad_bytes: int = 0
    all_grads_bytes: int = 0
    peak_bytes: int = 0
    memory_meter: str = ""
    via_activations: list[str] = field(default_factory=list)

    def memory(self) -> dict[str, Any]:
        """Return the memory figures as a JSON-ready dict."""
        return {"accumulator_bytes": self.accumulator_bytes, "peak_grad_bytes": self.peak_grad_bytes,
                "all_grads_bytes": self.all_grads_bytes, "peak_bytes": self.peak_bytes,
                "memory_meter": self.memory_meter, "via_activations": len(self.via_activations)}


def model_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The default calibration loss: ``model(**batch).loss``.

    Raises:
        RankwiseError: If the output has no ``.loss`` (the batch lacks labels).
    """
    loss = getattr(model(**batch), "loss", None)
    if loss is None:
        raise RankwiseError("GoRA needs batches that give a loss: model(**batch).loss is "
                            "None; include labels in the calibration batches")
    return loss


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _stable(prev: dict[str, float], cur: dict[str, float], tol: float) -> bool:
    return all(abs(cur[p] - prev[p]) <= tol * max(abs(prev[p]), 1e-30) for p in cur)


def _activation_hook(path: str, module: nn.Module, acc: dict[str, torch.Tensor]) -> Callable:
    """Forward hook adding ``dL/dy^T x`` (summed over tokens) into ``acc[path]`` at backward.

    The product is formed in the layer's compute dtype, as autograd forms a bf16 weight's
    ``.grad`` (no float32 copies of the activations), and the input is released as soon as it
    has been used.
    """
    conv1d = is_conv1d(layer_weights.base_layer(module))

    def hook(mod: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        held = [args[0].detach()]
        out = output if output.requires_grad else output.detach().requires_grad_()

        def grad_hook(g: torch.Tensor) -> None:
            x = held.pop()
            gy = g.reshape(-1, g.shape[-1])                   # (tokens, out)
            gx = x.reshape(-1, x.shape[-1]).to(gy.dtype)      # (tokens, in)
            a, b = (gx, gy) if conv1d else (gy, gx)           # storage (in, out) for Conv1D
            if gy.dtype == torch.float32:
                acc[path].addmm_(a.T, b)
            else:
                acc[path].add_(a.T @ b)                       # e.g. bf16, summed in float32
        out.register_hook(grad_hook)
        return out
    return hook


def _accumulators(grads_of: dict[str, torch.Tensor], layers: dict[str, nn.Module],
                  device: torch.device) -> dict[str, torch.Tensor]:
    """One zero fp32 accumulator per target, in its weight's storage layout."""
    acc = {p: torch.zeros(w.shape, dtype=torch.float32, device=device) for p, w in grads_of.items()}
    for p, m in layers.items():
        out_f, in_f = layer_weights.shape(m)
        acc[p] = torch.zeros((in_f, out_f) if is_conv1d(layer_weights.base_layer(m)) else (out_f, in_f),
                             dtype=torch.float32, device=device)
    return acc


def _grad_hook(path: str, targets: list[torch.Tensor], acc: dict[str, torch.Tensor],
               stats: GradStats) -> Callable[[torch.Tensor], None]:
    """Post-accumulate hook adding a weight's ``.grad`` into ``acc[path]`` and freeing it."""
    def hook(p: torch.Tensor) -> None:
        live = sum(t.grad.numel() * t.grad.element_size() for t in targets if t.grad is not None)
        stats.peak_grad_bytes = max(stats.peak_grad_bytes, live)
        acc[path].add_(p.grad.float())
        p.grad = None
    return hook


def _install_hooks(params: list[nn.Parameter], grads_of: dict[str, torch.Tensor],
                   layers: dict[str, nn.Module], acc: dict[str, torch.Tensor],
                   stats: GradStats) -> list:
    """Freeze every parameter but the target weights, hook the targets; return the handles."""
    targets = list(grads_of.values())
    for p in params:
        p.requires_grad_(False)
    handles = []
    for path, w in grads_of.items():
        w.requires_grad_(True)
        w.grad = None
        handles.append(w.register_post_accumulate_grad_hook(_grad_hook(path, targets, acc, stats)))
    for path, m in layers.items():
        handles.append(m.register_forward_hook(_activation_hook(path, m, acc)))
    return handles


def _run_batches(model: nn.Module, batches: Iterable[dict], n_batches: int, device: torch.device,
                 acc: dict[str, torch.Tensor], stats: GradStats, meter: PeakMemory,
                 score: Callable[[dict[str, torch.Tensor]], dict[str, float]] | None,
                 stop_tolerance: float, min_batches: int,
                 loss_fn: Callable[[nn.Module, dict], torch.Tensor]) -> None:
    """Backward over up to ``n_batches`` batches, stopping early once the importances settle."""
    it: Iterator[dict] = iter(batches)
    prev: dict[str, float] | None = None
    for _ in range(n_batches):
        try:
            batch = next(it)
        except StopIteration:
            break
        loss = loss_fn(model, _to_device(batch, device))
        if loss.requires_grad:
            loss.backward()
        stats.batches += 1
        meter.flush()
        if score is not None and stats.batches >= max(1, min_batches - 1):
            cur = score({p: a / stats.batches for p, a in acc.items()})
            stats.history.append(cur)
            if prev is not None and stats.batches >= min_batches and _stable(prev, cur, stop_tolerance):
                stats.early_stopped = stats.batches < n_batches
                break
            prev = cur


def _restore(meter: PeakMemory, handles: list, params: list[nn.Parameter],
             was_trainable: list[bool], targets: list[torch.Tensor]) -> None:
    """Stop the meter, remove the hooks, restore ``requires_grad`` and drop every ``.grad``."""
    meter.__exit__(None, None, None)
    for h in handles:
        h.remove()
    for p, t in zip(params, was_trainable):
        p.requires_grad_(t)
    for w in targets:
        w.grad = None


def accumulate_gradients(model: nn.Module, weights: dict[str, nn.Parameter | nn.Module],
                         batches: Iterable[dict], n_batches: int,
                         score: Callable[[dict[str, torch.Tensor]], dict[str, float]] | None = None,
                         stop_tolerance: float = 0.1, min_batches: int = 3,
                         loss_fn: Callable[[nn.Module, dict], torch.Tensor] = model_loss) -> GradStats:
    """Average d loss / d W over up to ``n_batches`` batches for each target in ``weights``.

    The model's ``requires_grad`` flags and train/eval mode are restored afterwards; the
    model's parameters are not changed and no ``.grad`` is left behind.

    Args:
        model: The model (its parameters are not changed).
        weights: ``{path: target}``: a weight parameter (its ``.grad`` is read), or a linear
            layer whose gradient is built from its activations (quantized layers).
        batches: Iterable of batch dicts (tensors are moved to the model's device).
        n_batches: Maximum number of batches.
        score: If given, ``score({path: averaged G}) -> {path: importance}`` is evaluated after
            every batch from ``min_batches - 1`` on, and accumulation stops once every
            importance changed by at most ``stop_tolerance`` (relative) since the last batch.
        stop_tolerance: See ``score``.
        min_batches: Never stop before this many batches.
        loss_fn: ``loss_fn(model, batch)`` -> scalar training loss (the engine's task gives
            its own; default ``model(**batch).loss``).

    Returns:
        The averaged gradients (storage layout) and the memory figures.

    Raises:
        RankwiseError: If there is no batch, or a batch gives no ``.loss``.
    """
    params = list(dict.fromkeys(model.parameters()))
    was_trainable = [p.requires_grad for p in params]
    grads_of = {p: w for p, w in weights.items() if isinstance(w, torch.Tensor)}
    layers = {p: w for p, w in weights.items() if not isinstance(w, torch.Tensor)}
    some = next(iter(weights.values()))
    device = (some if isinstance(some, torch.Tensor) else next(some.parameters())).device
    meter = PeakMemory(device).__enter__()  # the whole phase: accumulators included
    acc = _accumulators(grads_of, layers, device)
    targets = list(grads_of.values())
    target_ids = {id(w) for w in targets}
    stats = GradStats(grads={}, accumulator_bytes=sum(a.numel() * 4 for a in acc.values()),
                      all_grads_bytes=sum(p.numel() * p.element_size() for p, t in
                                          zip(params, was_trainable) if t or id(p) in target_ids),
                      via_activations=list(layers))
    handles = _install_hooks(params, grads_of, layers, acc, stats)
    try:
        _run_batches(model, batches, n_batches, device, acc, stats, meter, score,
                     stop_tolerance, min_batches, loss_fn)
    finally:
        _restore(meter, handles, params, was_trainable, targets)
    if stats.batches == 0:
        raise RankwiseError("GoRA got no calibration batch: set train.calibration_batches to 1 "
                            "or more (in Python: rankwise.apply(model, 'gora', batches=...))")
    stats.peak_bytes, stats.memory_meter = meter.peak_bytes, meter.meter
    stats.grads = {p: a.div_(stats.batches) for p, a in acc.items()}
    return stats
