"""Adapter tensors <-> Flower records, byte counting, and validation of client updates.

The adapter that travels is a flat ``{parameter name: tensor}`` dict (the parameters that
train under the run's method, named as in ``model.named_parameters()``). Tensors travel as
float32 (NumPy, hence Flower's ``Array``, has no bfloat16). Which of them are low-rank factors
is never read from a name: it is the *roles* mapping computed through the adapter protocol
(:mod:`rankwise.federated.wire`).
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping

import numpy as np
import torch

_LAYER_RE = re.compile(r"\.(?:layer|layers|h|block|blocks)\.(\d+)\.")


def to_record(state: Mapping[str, torch.Tensor]):
    """Pack tensors into a Flower ``ArrayRecord`` (float32, contiguous, on CPU).

    Args:
        state: ``{name: tensor}``.

    Returns:
        An ``ArrayRecord`` with the same keys.
    """
    from flwr.app import Array, ArrayRecord
    arrays = {k: Array(np.ascontiguousarray(v.detach().to("cpu", torch.float32).numpy()))
              for k, v in state.items()}
    return ArrayRecord(arrays)


def from_record(record) -> dict[str, torch.Tensor]:
    """Unpack an ``ArrayRecord`` into float32 tensors (copies, safe to modify).

    Args:
        record: A Flower ``ArrayRecord``.

    Returns:
        ``{name: tensor}``.
    """
    return {k: torch.from_numpy(np.array(v.numpy(), copy=True)).float() for k, v in record.items()}


def record_bytes(content) -> int:
    """Count the bytes of a message's records as Flower serializes them.

    Every object of the record tree is deflated (``deflate()``: header + body) and its
    length summed; each array's data chunks are counted once per array, so two equal
    arrays (e.g. two all-zero B factors) both count, as in a message that carries them.
    Flower's transport may skip objects the other side already holds; this count is the
    full serialized payload, an upper bound of what goes on the wire (gRPC framing excluded).

    Args:
        content: A ``RecordDict`` or an ``ArrayRecord`` / ``ConfigRecord`` / ``MetricRecord``.

    Returns:
        The number of bytes.
    """
    from flwr.app import ArrayRecord, RecordDict
    if isinstance(content, RecordDict):
        return len(content.deflate()) + sum(record_bytes(v) for v in content.values())
    if isinstance(content, ArrayRecord):
        total = len(content.deflate())
        for arr in content.values():
            total += len(arr.deflate()) + sum(len(c.deflate()) for _, c in arr.slice_array())
        return total
    return len(content.deflate())


def validate_update(update: Mapping[str, torch.Tensor],
                    expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    """List everything wrong with a client's update; empty means it may be aggregated.

    Args:
        update: The tensors a client sent.
        expected: ``{name: shape}`` the server asked for (exactly these keys).

    Returns:
        Problems such as ``"missing key 'x'"``, ``"key 'x' has shape (2, 3); expected (3, 2)"``,
        ``"key 'x' has 4 NaN/Inf values"``.
    """
    out = []
    missing = sorted(set(expected) - set(update))
    extra = sorted(set(update) - set(expected))
    if missing:
        out.append(f"missing keys {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    if extra:
        out.append(f"unexpected keys {extra[:3]}{' ...' if len(extra) > 3 else ''}")
    for name, shape in expected.items():
        if name not in update:
            continue
        t = update[name]
        if tuple(t.shape) != tuple(shape):
            out.append(f"key {name!r} has shape {tuple(t.shape)}; expected {tuple(shape)}")
            continue
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            out.append(f"key {name!r} has {bad} NaN/Inf values")
    return out


def layer_index(name: str) -> int | None:
    """Return the transformer block index in a parameter name, or ``None`` (heads, embeddings).

    Recognises ``.layer.3.`` (BERT), ``.h.3.`` (GPT-2), ``.layers.3.`` (Llama), ``.block.3.``.
    """
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def select_keys(names: Iterable[str], roles: Mapping[str, str], factors: str = "AB",
                layers: Iterable[int] = ()) -> list[str]:
    """The parameter names a client trains and sends for a round's plan.

    Rules (the same on server and client): a low-rank factor (``roles[name]`` is ``"A"`` or
    ``"B"``) trains only if its letter is in ``factors``; a parameter inside a numbered block
    trains only if ``layers`` is empty or holds its index; parameters that are neither factors
    nor inside a block (task head, modules to save) always train.

    Args:
        names: All exchangeable parameter names.
        roles: ``{name: "A" | "B"}`` of the factors among them (see
            :func:`rankwise.federated.wire.factor_roles`); names not in it are no factors.
        factors: ``"AB"``, ``"A"`` or ``"B"``.
        layers: Block indices allowed to train; empty means all.

    Returns:
        The selected names, in input order.
    """
    layers = set(layers)
    out = []
    for n in names:
        role = roles.get(n)
        if role is not None and role not in factors:
            continue
        idx = layer_index(n)
        if layers and idx is not None and idx not in layers:
            continue
        out.append(n)
    return out
