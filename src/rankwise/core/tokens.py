"""Trainable token rows: train a few rows of the embedding table (and of the output head) and
nothing else of it, next to any adapter method (``method.trainable_tokens``).

A new special token of a chat template needs its own input embedding (to be read) and its own
output-head row (to be emitted). Training the whole ``(V, d)`` table for that costs ``V d``
trainable values and the same again in optimizer state; this module trains a ``(k, d)`` delta
for the ``k`` chosen token ids instead, as HF PEFT's ``trainable_token_indices`` does:

* input embedding (:class:`TokenRows`): ``e(t) = E[t] + Δ[j]`` when ``t = ids[j]``, else
  ``E[t]``, computed as ``E[x] + onehot(x == ids) Δ`` (``(B, T, k) @ (k, d)``), so no copy of
  the table is made per forward;
* output head (:class:`TokenHeadRows`): ``logits[..., ids] += h Δ_headᵀ``. When the head is tied
  to the embedding (GPT-2, most small models) it uses the embedding layer's ``Δ``: the two stay
  tied, during training and after a merge (one shared weight gets the rows once). An untied head
  trains its own ``Δ_head`` for the same ids.

``Δ`` starts at zero, so the adapted model computes the base model's output at init. Merging
writes ``E[ids] + Δ`` into the table (the rows it replaced are kept, so unmerging is exact).
Both layers implement the :class:`~rankwise.core.protocol.AdapterModule` protocol, so counting,
freezing, saving, loading, switching and merging go through the same code as every method's
layers; :func:`rebuild_tokens` recreates them from their ``describe`` (no tokenizer needed).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rankwise.core.inject import replace_module
from rankwise.core.protocol import NamedAdapters, adapter_modules
from rankwise.core.weights import base_layer as base_layer_of
from rankwise.errors import RankwiseError

KIND = "trainable-tokens"


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)


class _Rows(NamedAdapters, nn.Module):
    """What both layers share: per adapter name a ``(k, d)`` delta for the rows ``token_ids``,
    merging by writing ``W[ids] + Δ`` into the base weight (rows kept for an exact unmerge)."""

    adapters_attr = "deltas"

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.deltas = nn.ParameterDict()
        self.token_ids: dict[str, list[int]] = {}
        self._active: list[str] = []
        self._merged: dict[str, torch.Tensor] = {}  # name -> the rows the merge replaced

    @property
    def weight(self) -> torch.Tensor:
        """The base table (transformers reads ``get_input_embeddings().weight``, e.g. to tie)."""
        return base_layer_of(self.base_layer).weight

    def add(self, name: str, token_ids: list[int], width: int) -> None:
        """Add adapter ``name``: a zero ``(len(token_ids), width)`` float32 delta."""
        if name in self.deltas:
            raise RankwiseError(f"trainable tokens: this layer already holds adapter {name!r}")
        w = self.weight
        self.token_ids[name] = [int(t) for t in token_ids]
        self.deltas[name] = nn.Parameter(torch.zeros(len(token_ids), width, device=w.device))
        self._active = list(dict.fromkeys(self._active + [name]))

    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """``{"token_delta": Δ}`` of adapter ``name`` (the stable file key)."""
        return {"token_delta": self.deltas[name]}

    def describe(self, name: str) -> dict[str, Any]:
        """The saved structure: the layer kind, its role and the token ids of ``name``."""
        return {"kind": KIND, "role": self.role, "token_ids": list(self.token_ids[name])}

    def _own_merge(self, name: str) -> None:
        w = self.weight
        idx = _index(self.token_ids[name], w.device)
        with torch.no_grad():
            self._merged[name] = w[idx].clone()
            w.index_copy_(0, idx, (w[idx].float() + self.deltas[name].float()).to(w.dtype))

    def merge(self, name: str) -> None:
        """Write ``W[ids] + Δ`` into the base weight (once; a second merge is a no-op)."""
        if name in self.deltas and name not in self._merged:
            self._own_merge(name)

    def unmerge(self) -> None:
        """Put back every row a merge replaced (exact)."""
        w = self.weight
        with torch.no_grad():
            for name in reversed(list(self._merged)):
                w.index_copy_(0, _index(self.token_ids[name], w.device), self._merged.pop(name))

    def delete(self, name: str) -> None:
        """Remove adapter ``name`` (unmerged first)."""
        if name in self._merged:
            self.unmerge()
        self.deltas.pop(name, None)
        self.token_ids.pop(name, None)
        self._forget(name)

    def _live(self) -> list[str]:
        """Active adapters whose delta is not already in the weight."""
        return [n for n in self._active if n not in self._merged]


class TokenRows(_Rows):
    """Trainable rows of an input embedding: ``E[x] + onehot(x == ids) Δ`` (PEFT's
    TrainableTokens, Δ as an additive delta that starts at zero).

    Args:
        base_layer: The ``nn.Embedding`` (possibly scaled, as Gemma's, via ``embed_scale``).
        token_ids: The rows that train.
        name: The adapter name.
    """

    role = "embedding"

    def __init__(self, base_layer: nn.Module, token_ids: list[int], name: str = "default") -> None:
        super().__init__(base_layer)
        self.add(name, token_ids, self.weight.shape[1])

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Embed token ids ``x`` (B, T): the base embedding plus Δ on the trainable rows."""
        out = self.base_layer(x, *args, **kwargs)                    # (B, T, d)
        scale = getattr(base_layer_of(self.base_layer), "embed_scale", None)
        for name in self._live():
            delta = self.deltas[name]
            hit = (x.unsqueeze(-1) == _index(self.token_ids[name], x.device)).to(delta.dtype)  # (B, T, k)
            extra = hit @ delta                                      # (B, T, d)
            if scale is not None:
                extra = extra * scale.to(extra.dtype)
            out = out + extra.to(out.dtype)
        return out


class TokenHeadRows(_Rows):
    """Trainable rows of the output head: ``logits[..., ids] += h Δᵀ``.

    Args:
        base_layer: The output head (``lm_head``, an ``nn.Linear`` of shape ``(V, d)``).
        token_ids: The rows that train.
        name: The adapter name.
        tied: The embedding's :class:`TokenRows` when the head shares its weight: the head then
            uses that layer's Δ and merge state (kept out of this module's parameters, so Δ is
            counted, saved and stepped once) and the two stay tied.
    """

    role = "head"

    def __init__(self, base_layer: nn.Module, token_ids: list[int], name: str = "default",
                 tied: TokenRows | None = None) -> None:
        super().__init__(base_layer)
        self._tied = [tied] if tied is not None else []  # a list: not a submodule
        if tied is None:
            self.add(name, token_ids, self.weight.shape[1])
        else:
            self.token_ids[name] = [int(t) for t in token_ids]
            self._active = [name]

    @property
    def tied(self) -> TokenRows | None:
        """The embedding layer this head is tied to, if any."""
        return self._tied[0] if self._tied else None

    def adapter_names(self) -> list[str]:
        """The adapter names (the tied embedding's when tied)."""
        return list(self.token_ids)

    def set_active(self, names: list[str]) -> None:
        """Use ``names`` in forward."""
        self._active = [n for n in names if n in self.token_ids]

    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """Own delta; none when tied (the embedding layer holds and saves it)."""
        return {} if self.tied is not None else super().adapter_params(name)

    def describe(self, name: str) -> dict[str, Any]:
        """As :meth:`_Rows.describe`, plus whether the head is tied to the embedding."""
        return {**super().describe(name), "tied": self.tied is not None}

    def merge(self, name: str) -> None:
        """Untied: write the rows; tied: nothing (the embedding layer merges the shared weight)."""
        if self.tied is None:
            super().merge(name)

    def unmerge(self) -> None:
        """Untied: restore the rows; tied: nothing."""
        if self.tied is None:
            super().unmerge()

    def delete(self, name: str) -> None:
        """Remove adapter ``name``."""
        if self.tied is None:
            super().delete(name)
        else:
            self.token_ids.pop(name, None)
            self._forget(name)

    def forward(self, h: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Logits of hidden states ``h`` (..., d): the base head plus ``h Δᵀ`` on the rows."""
        out = self.base_layer(h, *args, **kwargs)                    # (..., V)
        owner = self.tied or self
        for name in self._active:
            if name in owner._merged or name not in owner.deltas:
                continue
            delta = owner.deltas[name]                               # (k, d)
            rows = h.to(delta.dtype) @ delta.T                       # (..., k)
            out = out.index_add(-1, _index(self.token_ids[name], out.device), rows.to(out.dtype))
        return out


def _path_of(model: nn.Module, module: nn.Module) -> str | None:
    return next((p for p, m in model.named_modules() if m is module), None)


def _token_layer(model: nn.Module, path: str, cls: type) -> nn.Module | None:
    mod = model.get_submodule(path)
    if isinstance(mod, cls):
        return mod
    if any(p == path for p, _ in adapter_modules(model)):
        raise RankwiseError(f"method.trainable_tokens: {path!r} is already adapted by the method; "
                            f"remove it from method.targets / method.modules_to_save")
    return None


def add_trainable_tokens(model: nn.Module, token_ids: list[int], name: str = "default",
                         head: bool = True) -> dict[str, nn.Module]:
    """Train the rows ``token_ids`` of the input embedding (and of the output head) as adapter
    ``name``; nothing else is frozen or unfrozen here (call ``mark_trainable`` after).

    Args:
        model: A transformers model (``get_input_embeddings`` / ``get_output_embeddings``).
        token_ids: Vocabulary ids whose rows train.
        name: The adapter name.
        head: Also the output head's rows (tied: the same Δ; untied: its own).

    Returns:
        ``{path: layer}`` of the layers added.

    Raises:
        RankwiseError: An id outside the vocabulary, no input embedding, or an embedding / head
            that another adapter layer already wraps.
    """
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        raise RankwiseError(f"method.trainable_tokens: {type(model).__name__} has no input embedding")
    vocab = base_layer_of(emb).weight.shape[0]
    bad = [t for t in token_ids if not 0 <= int(t) < vocab]
    if bad or not token_ids:
        raise RankwiseError(f"method.trainable_tokens: token ids {bad or token_ids} are not rows of "
                            f"the {vocab}-row embedding")
    out: dict[str, nn.Module] = {}
    path = _path_of(model, emb)
    rows = _token_layer(model, path, TokenRows)
    if rows is None:
        rows = TokenRows(emb, token_ids, name)
        replace_module(model, path, rows)
    else:
        rows.add(name, token_ids, rows.weight.shape[1])
    out[path] = rows
    out_emb = model.get_output_embeddings() if head and hasattr(model, "get_output_embeddings") else None
    if out_emb is None:
        return out
    hpath = _path_of(model, out_emb)
    tied = base_layer_of(out_emb).weight is rows.weight
    layer = _token_layer(model, hpath, TokenHeadRows)
    if layer is None:
        layer = TokenHeadRows(out_emb, token_ids, name, tied=rows if tied else None)
        replace_module(model, hpath, layer)
    elif tied:
        layer.token_ids[name] = list(token_ids)
        layer._active = list(dict.fromkeys(layer._active + [name]))
    else:
        layer.add(name, token_ids, layer.weight.shape[1])
    out[hpath] = layer
    return out


def is_token_structure(entry: dict[str, Any]) -> bool:
    """Whether a saved ``describe`` entry belongs to a trainable-token layer."""
    return isinstance(entry, dict) and entry.get("kind") == KIND


def token_ids(model: nn.Module, name: str = "default") -> list[int]:
    """The trainable token ids of adapter ``name`` (empty when it has none)."""
    for _, mod in adapter_modules(model):
        if isinstance(mod, TokenRows) and name in mod.token_ids:
            return list(mod.token_ids[name])
    return []


def rebuild_tokens(model: nn.Module, layers: dict[str, dict[str, Any]], name: str = "default") -> None:
    """Recreate the trainable-token layers of a saved structure (weights not loaded).

    Args:
        model: The base model (its method layers may already be rebuilt).
        layers: ``{path: describe}`` entries for which :func:`is_token_structure` holds.
        name: The adapter name.

    Raises:
        RankwiseError: If the saved paths are not this model's embedding / head.
    """
    emb = [e for e in layers.values() if e.get("role") == "embedding"]
    if not emb:
        return
    heads = [(p, e) for p, e in layers.items() if e.get("role") == "head"]
    added = add_trainable_tokens(model, emb[0]["token_ids"], name, head=bool(heads))
    if sorted(added) != sorted(layers):
        raise RankwiseError(f"the saved trainable-token layers {sorted(layers)} are not this "
                            f"model's embedding and head {sorted(added)}; load onto the base "
                            "model it was trained on")
