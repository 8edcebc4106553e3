"""``train.compile: true``: ``torch.compile`` of the model's repeated blocks.

Each block of every ``nn.ModuleList`` (a transformer's layers; the units FSDP2 shards) is
compiled in place (``nn.Module.compile``: parameter names, state dicts, hooks and adapter
protocol stay as they were); a model without such a list has its whole forward compiled. The
blocks share one code object, so one compilation (per ``requires_grad`` pattern of the input,
and once more when lengths first vary: dynamic shapes) serves every layer; the backward is
compiled by AOTAutograd. The top model's own code (masks, the loss, input adapters' hooks)
stays eager.

A method whose layers dynamo cannot trace is found before training: :func:`compile_problem`
runs one forward and backward of a real batch through the compiled model and turns a tracing
or backend error into one line naming the method.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def compile_model(model: nn.Module, backend: str = "inductor") -> int:
    """Compile ``model``'s blocks in place (see the module docstring).

    Args:
        model: The model.
        backend: ``torch.compile``'s backend (tests use ``aot_eager``: the same tracing and
            AOTAutograd graphs without inductor's code generation).

    Returns:
        How many modules were compiled.
    """
    blocks = [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m]
    for block in blocks or [model]:
        block.compile(backend=backend, dynamic=None)
    return len(blocks) or 1


def compile_problem(model: nn.Module, method: str, run: Callable[[], Any]) -> str | None:
    """Why the compiled ``model`` cannot train (``None`` when it can).

    Args:
        model: A model after :func:`compile_model`.
        method: ``method.name``, for the message.
        run: One forward and backward of a training batch (its gradients are dropped and the
            RNG state restored after it, so the run is unchanged).

    Returns:
        A one-line reason naming the fix, or ``None``.
    """
    state = torch.get_rng_state()
    try:
        run()
    except Exception as err:  # dynamo's Unsupported, BackendCompilerFailed, InternalTorchDynamoError ...
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        return (f"train.compile: torch.compile cannot trace method {method!r} ({type(err).__name__}: "
                f"{first}); set train.compile: false")
    finally:
        torch.set_rng_state(state)
        for p in model.parameters():
            p.grad = None
    return None


__all__ = ["compile_model", "compile_problem"]
