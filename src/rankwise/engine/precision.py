"""Training precision: which ``train.precision`` a device can run (:func:`precision_problem`,
checked by running what a step runs) and the autocast context a step runs under."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_problem(precision: str, device: str) -> str | None:
    """Why ``device`` cannot train in ``precision`` (``None`` when it can).

    The check runs what a step runs: a linear layer's forward and backward under autocast in
    the precision's dtype (and, for fp16, a gradient-scaler step) on the device; bf16 on a
    CUDA device also needs ``torch.cuda.is_bf16_supported()``.

    Args:
        precision: ``fp32``, ``bf16`` or ``fp16``.
        device: ``cpu``, ``cuda``, ``cuda:1`` ...

    Returns:
        A one-line reason naming the fix, or ``None``.
    """
    dtype = PRECISIONS.get(precision)
    if dtype is None:
        return None
    kind = str(device).split(":")[0]
    fix = "set train.precision to " + ("bf16 or fp32" if precision == "fp16" else "fp16 or fp32")
    if kind == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        return f"train.precision bf16: this GPU has no bfloat16 support; {fix}"
    try:
        _probe(precision, dtype, str(device))
    except (RuntimeError, NotImplementedError, AssertionError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"train.precision {precision}: {kind} cannot run {dtype} autocast ({reason}); {fix}"
    return None


def _probe(precision: str, dtype: torch.dtype, device: str) -> None:
    """One tiny autocast forward/backward (and scaler step for fp16) on ``device``."""
    kind = device.split(":")[0]
    if not torch.amp.is_autocast_available(kind):
        raise RuntimeError(f"no autocast for device type {kind!r}")
    layer = nn.Linear(8, 8).to(device)
    with torch.autocast(kind, dtype=dtype):
        out = layer(torch.randn(2, 8, device=device))
    if out.dtype != dtype:
        raise RuntimeError(f"autocast produced {out.dtype}")
    loss = out.float().sum()
    if precision == "fp16":
        scaler = torch.amp.GradScaler(kind)
        opt = torch.optim.SGD(layer.parameters(), lr=0.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()


def autocast(precision: str, device: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on ``device`` in the dtype of ``precision`` (``fp32``: a null context)."""
    dtype = PRECISIONS[precision]
    kind = str(device).split(":")[0]
    return contextlib.nullcontext() if dtype is None else torch.autocast(kind, dtype=dtype)
