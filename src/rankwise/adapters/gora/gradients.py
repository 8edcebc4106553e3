"""Step 1 of GoRA: average the loss gradient of each target weight over calibration batches.

Memory: only the target weights require grad during this phase; a post-accumulate hook on
each of them adds its ``.grad`` into an fp32 accumulator and frees the ``.grad`` at once, so
besides the accumulators (which GoRA needs: importance and B's initialisation read the full
averaged G) at most one transient full-size gradient is alive per backward step, instead of a
``.grad`` for every trainable parameter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from rankwise.errors import RankwiseError
from rankwise.memory import rss_mb as _rss_mb


@dataclass
class GradStats:
    """What :func:`accumulate_gradients` measured.

    Attributes:
        grads: ``{path: averaged gradient}`` in the weight's own layout (fp32).
        batches: How many batches were used.
        early_stopped: Whether the importance test stopped before the last batch.
        history: Importances after each batch (``[{path: I}]``), for the stopping rule.
        accumulator_bytes: Bytes held by the accumulators.
        peak_grad_bytes: Largest sum of live ``.grad`` bytes seen on target weights at a hook.
        all_grads_bytes: Bytes a plain ``backward()`` over every trainable parameter would keep
            in ``.grad`` (what the hooks avoid).
        cuda_peak_bytes: ``torch.cuda.max_memory_allocated`` growth during the phase (CUDA only).
        rss_peak_mb: Resident-set growth over the phase in MiB, sampled at every hook and after
            every backward (CPU; Linux ``/proc``, else 0). Noisy for small models.
    """

    grads: dict[str, torch.Tensor]
    batches: int = 0
    early_stopped: bool = False
    history: list[dict[str, float]] = field(default_factory=list)
    accumulator_bytes: int = 0
    peak_grad_bytes: int = 0
    all_grads_bytes: int = 0
    cuda_peak_bytes: int | None = None
    rss_peak_mb: float = 0.0

    def memory(self) -> dict[str, Any]:
        """Return the memory figures as a JSON-ready dict."""
        return {"accumulator_bytes": self.accumulator_bytes, "peak_grad_bytes": self.peak_grad_bytes,
                "all_grads_bytes": self.all_grads_bytes, "cuda_peak_bytes": self.cuda_peak_bytes,
                "rss_peak_mb": round(self.rss_peak_mb, 2)}


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


def accumulate_gradients(model: nn.Module, weights: dict[str, nn.Parameter],
                         batches: Iterable[dict], n_batches: int,
                         score: Callable[[dict[str, torch.Tensor]], dict[str, float]] | None = None,
                         stop_tolerance: float = 0.1, min_batches: int = 3,
                         loss_fn: Callable[[nn.Module, dict], torch.Tensor] = model_loss) -> GradStats:
    """Average d loss / d W over up to ``n_batches`` batches for each weight in ``weights``.

    The model's ``requires_grad`` flags and train/eval mode are restored afterwards; the
    model's parameters are not changed and no ``.grad`` is left behind.

    Args:
        model: The model (its parameters are not changed).
        weights: ``{path: weight parameter}`` of the target layers.
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
        The averaged gradients and the memory figures.

    Raises:
        RankwiseError: If there is no batch, or a batch gives no ``.loss``.
    """
    params = list(dict.fromkeys(model.parameters()))
    was_trainable = [p.requires_grad for p in params]
    device = next(iter(weights.values())).device
    acc = {path: torch.zeros(w.shape, dtype=torch.float32, device=device)
           for path, w in weights.items()}
    targets = list(weights.values())
    target_ids = {id(w) for w in targets}
    stats = GradStats(grads={}, accumulator_bytes=sum(a.numel() * 4 for a in acc.values()),
                      all_grads_bytes=sum(p.numel() * p.element_size() for p, t in
                                          zip(params, was_trainable) if t or id(p) in target_ids))

    def make_hook(path: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            live = sum(t.grad.numel() * t.grad.element_size() for t in targets if t.grad is not None)
            stats.peak_grad_bytes = max(stats.peak_grad_bytes, live)
            acc[path].add_(p.grad.float())
            p.grad = None
            stats.rss_peak_mb = max(stats.rss_peak_mb, _rss_mb() - rss0)
        return hook

    rss0 = _rss_mb()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    for p in params:
        p.requires_grad_(False)
    handles = []
    for path, w in weights.items():
        w.requires_grad_(True)
        w.grad = None
        handles.append(w.register_post_accumulate_grad_hook(make_hook(path)))
    try:
        it: Iterator[dict] = iter(batches)
        prev: dict[str, float] | None = None
        for _ in range(n_batches):
            try:
                batch = next(it)
            except StopIteration:
                break
            loss_fn(model, _to_device(batch, device)).backward()
            stats.batches += 1
            stats.rss_peak_mb = max(stats.rss_peak_mb, _rss_mb() - rss0)
            if score is not None and stats.batches >= max(1, min_batches - 1):
                cur = score({p: a / stats.batches for p, a in acc.items()})
                stats.history.append(cur)
                if prev is not None and stats.batches >= min_batches and _stable(prev, cur, stop_tolerance):
                    stats.early_stopped = stats.batches < n_batches
                    break
                prev = cur
    finally:
        for h in handles:
            h.remove()
        for p, t in zip(params, was_trainable):
            p.requires_grad_(t)
        for w in targets:
            w.grad = None
    if stats.batches == 0:
        raise RankwiseError("GoRA got no calibration batch: set train.calibration_batches to 1 "
                            "or more (in Python: rankwise.apply(model, 'gora', batches=...))")
    if cuda:
        torch.cuda.synchronize(device)
        stats.cuda_peak_bytes = int(torch.cuda.max_memory_allocated(device) - base)
    stats.grads = {p: a.div_(stats.batches) for p, a in acc.items()}
    return stats
