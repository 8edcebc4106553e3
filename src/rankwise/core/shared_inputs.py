"""Which layers read one input tensor: fixed once, by one probe forward, before the first step.

A compute path that serves several layers from one product - the fused LoRA path's
``x [A_q; A_k; A_v]`` (``adapters/lora/fused.py``, ``docs/fused-lora.md``) - must know which
layers the model calls one after another on the very same tensor: q, k and v on the attention's
normed input, gate and up on the MLP's. Only the model's code says so (transformers' attention
calls ``q_proj``, ``k_proj``, ``v_proj`` from its own ``forward``), so :func:`fix_groups` runs
the model once on a probe batch (:func:`rankwise.core.probe.probe_batch`: 8 token ids) and
records the calls:

* the watched layers, every adapter layer on a linear base and every linear-like leaf
  (``nn.Linear``, bitsandbytes' linears, GPT-2's ``Conv1D``) return zeros of their output
  shape: no weight is read or dequantized and no layer's state changes (bitsandbytes fixes its
  compute dtype, and on some CPUs repacks a weight, on a layer's first no-grad call); only the
  embeddings, norms and attention run, on 8 tokens;
* in eval mode (no dropout, no checkpointing wrapper, no batch-norm statistics), without
  autograd, with torch's random state forked and every module's mode restored: the probe
  changes nothing a run computes;
* watched layers called one after another on one tensor object form a run; a run of two or
  more is a group whose first layer is its leader (a layer belongs to one group at most).

The groups depend only on the model's structure and the fixed probe batch, so a fresh run, a
resumed one and a federated client rebuilt in another process fix the same groups before their
first micro-batch, and nothing needs to be stored in a checkpoint. They are held weakly, keyed
by the leader object: a deep copy of the model (a DPO reference) has no groups, and its layers
compute their own products. A model that cannot be probed (no integer input embedding, or a
forward that needs more than token ids) gets no groups, with a warning.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from rankwise.core import weights as layer_weights
from rankwise.core.inject import is_conv1d
from rankwise.core.probe import probe_batch

_GROUPS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()  # leader -> partner refs
_MISSING = object()


def partners(leader: nn.Module) -> tuple[nn.Module, ...]:
    """The layers of ``leader``'s group after it, in call order (empty if it leads none).

    Args:
        leader: A layer :func:`fix_groups` was given.

    Returns:
        The live partner layers.
    """
    refs = _GROUPS.get(leader, ())
    return tuple(p for r in refs if (p := r()) is not None)


def forget(layers: Iterable[nn.Module]) -> None:
    """Drop the groups that ``layers`` lead: each of them computes its own products again.

    Args:
        layers: Layers :func:`fix_groups` may have been given.
    """
    for layer in layers:
        _GROUPS.pop(layer, None)


def fix_groups(model: nn.Module, layers: Iterable[nn.Module],
               batch: dict | None = None) -> list[tuple[str, ...]]:
    """Find which of ``layers`` read one input tensor (module docstring) and hold the groups.

    Earlier groups led by any of ``layers`` are dropped first.

    Args:
        model: The model whose forward calls ``layers``.
        layers: The layers that may share a product (e.g. the fused LoRA layers).
        batch: The probe inputs (``model(**batch)``); default: :func:`probe_batch`.

    Returns:
        Each group as the module paths of its layers, leader first, in call order.
    """
    layers = list(layers)
    forget(layers)
    if len(layers) < 2:
        return []
    batch = probe_batch(model) if batch is None else batch
    if batch is None:
        warnings.warn("shared inputs: the model has no integer input embedding to probe; each "
                      "layer computes its own products", stacklevel=2)
        return []
    try:
        calls = _record(model, layers, batch)
    except Exception as exc:  # a forward that needs more than token ids: no groups, same numbers
        warnings.warn(f"shared inputs: the probe forward failed ({type(exc).__name__}: {exc}); "
                      "each layer computes its own products", stacklevel=2)
        return []
    paths = {id(m): p for p, m in model.named_modules()}
    groups, taken = [], set()
    for run in _runs(calls):
        if any(id(m) in taken for m in run):  # a block called twice: its first run decides
            continue
        taken.update(id(m) for m in run)
        _GROUPS[run[0]] = tuple(weakref.ref(m) for m in run[1:])
        groups.append(tuple(paths.get(id(m), "?") for m in run))
    return groups


def _runs(calls: list[tuple[nn.Module, torch.Tensor]]) -> list[list[nn.Module]]:
    """Maximal runs of consecutive calls on one tensor object, no layer twice, two or more."""
    runs: list[list[nn.Module]] = []
    run: list[nn.Module] = []
    last = None
    for layer, x in calls:
        if run and x is last and all(m is not layer for m in run):
            run.append(layer)
            continue
        if len(run) > 1:
            runs.append(run)
        run, last = [layer], x
    if len(run) > 1:
        runs.append(run)
    return runs


def _linear_like(module: nn.Module) -> bool:
    base = layer_weights.base_layer(module)
    return isinstance(base, nn.Linear) or is_conv1d(base)


def _stub(module: nn.Module, calls: list | None):
    """A forward that returns zeros of ``module``'s output shape (and records its call)."""
    out_features = layer_weights.shape(module)[0]

    def forward(x, *args, **kwargs):
        if calls is not None:
            calls.append((module, x))  # the tensor itself: ids of freed tensors are reused
        return x.new_zeros(*x.shape[:-1], out_features)  # (..., out)
    return forward


def _record(model: nn.Module, layers: list[nn.Module], batch: dict) -> list[tuple[nn.Module, torch.Tensor]]:
    """``[(watched layer, its input)]`` in call order, from one side-effect-free forward."""
    watched = {id(m) for m in layers}
    calls: list[tuple[nn.Module, torch.Tensor]] = []
    stubbed: dict[nn.Module, object] = {}
    modes = [(m, m.training) for m in model.modules()]
    for m in model.modules():
        if id(m) in watched or _linear_like(m):
            stubbed[m] = m.__dict__.get("forward", _MISSING)  # accelerate's hooks live there
            m.forward = _stub(m, calls if id(m) in watched else None)
    device = next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    accel = [device] if device.type not in ("cpu", "meta") else []
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=accel, device_type=device.type if accel else "cuda"):
            model(**batch)
    finally:
        for m, forward in stubbed.items():
            if forward is _MISSING:
                del m.forward
            else:
                m.forward = forward
        for m, mode in modes:
            m.training = mode
    return calls
