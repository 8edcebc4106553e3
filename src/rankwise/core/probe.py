"""A loaded adapter that does nothing is an error: one probe batch through the model, with the
adapter and without it.

The silent no-op users keep hitting (unsloth #2142, sentence-transformers #3865): an adapter
loads without a complaint, its weights are non-zero, and the model's output is the base's,
because the adapted modules are not the ones the forward calls (a fused or re-implemented
forward reads ``module.weight`` itself, a wrapper replaced the module after loading...).
:func:`check_effect` runs after :func:`rankwise.load_adapter` and :func:`rankwise.load_peft`:

* it looks only at LoRA-shaped layers (the protocol's ``factors``; ``delta_factors`` where a
  residual init keeps a frozen pair) whose weight change ``s B A`` is not zero: a freshly
  initialised adapter (``B = 0``) is expected to change nothing;
* it runs one forward of a probe batch (8 token ids) in eval mode with only that adapter on,
  and one with every adapter off, recording which adapter layers the forward called;
* an expected change whose layers were never called, or outputs that are bit-identical though
  some change is at least ``1e-3`` of its base weight's norm (far above bf16 rounding), raises.

Models it cannot build a batch for (no integer input embedding) or whose forward refuses the
probe are not checked.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rankwise.core.protocol import adapter_modules
from rankwise.errors import RankwiseError

RELATIVE = 1e-3  # a weight change this large relative to its base weight must reach the output
PROBE_TOKENS = 8


def _delta_norm(module: nn.Module, name: str) -> float | None:
    """``||s B A||_F`` of a LoRA-shaped layer (``None`` for other layers), computed as
    ``sqrt(sum((BᵀB) ∘ (AAᵀ)))`` in float64 so no ``(out, in)`` matrix is formed."""
    pair = getattr(module, "delta_factors", None)
    pair = pair(name) if callable(pair) else None
    if pair is None:
        fn = getattr(module, "factors", None)
        pair = fn(name) if callable(fn) else None
    if pair is None:
        return None
    a, b = (t.detach().double() for t in pair)  # A (r, in), B (out, r)
    if a.dim() != 2 or b.dim() != 2:
        return None
    sq = float(((b.T @ b) * (a @ a.T)).sum().clamp(min=0))
    scale = getattr(module, "scaling", {})
    scale = float(scale.get(name, 1.0)) if isinstance(scale, dict) else 1.0
    tiny = 1e-10 * float((b * b).sum()) * float((a * a).sum())  # exact cancellation, in rounding
    return abs(scale) * sq ** 0.5 if sq > tiny else 0.0


def _base_norm(module: nn.Module) -> float | None:
    from rankwise.core.weights import dense_weight
    try:
        return float(dense_weight(module).detach().float().norm())
    except Exception:  # a base this module does not expose as a matrix
        return None


def probe_batch(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Eight token ids for ``model`` (and decoder ids for an encoder-decoder), or ``None``."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    vocab = getattr(emb, "num_embeddings", None)
    weight = getattr(emb, "weight", None)
    if not vocab or weight is None:
        return None
    ids = (torch.arange(PROBE_TOKENS) * 7 + 3).remainder(vocab).unsqueeze(0).to(weight.device)  # (1, T)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        batch["decoder_input_ids"] = ids
    return batch


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _forwards(model: nn.Module, name: str, layers: dict[str, nn.Module], batch: dict):
    """``(output with only ``name`` on, output with every adapter off, paths called)``."""
    mods = [m for _, m in adapter_modules(model)]
    saved = [m.active_names() for m in mods]
    called: set[str] = set()
    hooks = [m.register_forward_hook(lambda *_, p=p: called.add(p)) for p, m in layers.items()]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for m in mods:
                m.set_active([name] if name in m.adapter_names() else [])
            on = _first_tensor(model(**batch))
            reached = set(called)
            for m in mods:
                m.set_active([])
            off = _first_tensor(model(**batch))
    finally:
        for h in hooks:
            h.remove()
        for m, names in zip(mods, saved):
            m.set_active(names)
        model.train(training)
    return on, off, reached


def check_effect(model: nn.Module, name: str = "default", batch: dict | None = None) -> None:
    """Raise if adapter ``name`` should change ``model``'s output and does not (module docstring).

    Args:
        model: A model that just had adapter ``name`` loaded.
        name: The adapter.
        batch: The probe inputs (``model(**batch)``); default: :func:`probe_batch`.

    Raises:
        RankwiseError: The adapter's layers are never called, or the output is unchanged.
    """
    layers = {p: m for p, m in adapter_modules(model) if name in m.adapter_names()}
    norms = {p: _delta_norm(m, name) for p, m in layers.items()}
    changing = [p for p, n in norms.items() if n]
    batch = batch if batch is not None else probe_batch(model)
    if not changing or batch is None or any(getattr(m, "merged", False) for m in layers.values()):
        return
    try:
        on, off, reached = _forwards(model, name, {p: layers[p] for p in changing}, batch)
    except Exception:  # a model whose forward needs more than token ids: not probed
        return
    if not reached:
        raise RankwiseError(f"adapter {name!r} loaded but does nothing: the model's forward never "
                            f"calls its layers (e.g. {changing[0]!r}), which hold a non-zero weight "
                            "change; load it into the model class it was trained on (the adapted "
                            "modules must be the ones the forward runs)")
    if on is None or off is None or on.shape != off.shape or not torch.equal(on, off):
        return
    relative = [(p, norms[p] / b) for p in changing if (b := _base_norm(layers[p]))]
    if any(r >= RELATIVE for _, r in relative):
        path, r = max(relative, key=lambda x: x[1])
        raise RankwiseError(f"adapter {name!r} loaded but does nothing: the model's output is "
                            f"identical with and without it, though {path!r} changes its weight by "
                            f"{r:.1%}; the adapted modules are not the ones the forward uses: load "
                            "it into the model class it was trained on")
