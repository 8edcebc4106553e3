"""The virtual-token seam: a wrapper of the input embeddings that is both an ``AdapterModule``
(saving, counting, switching) and an ``InputAdapter`` (``transform_inputs``).

The wrapper leaves the embedding lookup unchanged; before every forward the engine's tasks (and
generation) pass the batch through :func:`rankwise.core.protocol.transform_inputs`, which calls
:meth:`PromptLayer.transform_inputs`: the ids become ``inputs_embeds`` with the active
generator's ``v`` vectors in front, and the attention mask, ``token_type_ids`` and labels grow by
``v`` positions. Label rule (causal LM, labels ``(B, T)``): the virtual positions carry no loss,
and neither does the first real token, which the base model never predicts either, so the
number of targets, the loss and the perplexity are those of the base model's target set
(``Task.count_targets`` needs no change; HF PEFT's training loss also scores that first token,
its logits are the same). Class labels ``(B,)`` are left alone.

A *generator* (:mod:`rankwise.adapters.prompt.generators`) makes the ``(B, v, hidden)``
prefix; the wrapper holds one per model.

Decoder classifiers (``GPT2ForSequenceClassification``, ``LlamaForSequenceClassification`` and
the other ``*ForSequenceClassification`` models with a ``score`` head) read the logits of the
last token that is not padding, found from ``input_ids``; given ``inputs_embeds`` they read the
last position, which is padding in a right-padded batch. The wrapper therefore computes the
position the un-prompted model would read (the last ``input_ids`` entry unlike
``config.pad_token_id``, else the last attended token), shifted by ``v``, and a forward hook on
``score`` puts that position's logits at the last position, where the model pools them.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rankwise.core.protocol import Unmergeable
from rankwise.errors import RankwiseError

IGNORE_INDEX = -100  # transformers' "no loss here" label (rankwise.engine.task.IGNORE)
_POOL_HOOKED = "_rankwise_reads_last_real_token"  # flag on a score head carrying our hook


def sequence_score_head(model: nn.Module) -> nn.Module | None:
    """The ``score`` head of a decoder sequence classifier (which pools the last non-pad
    token), or ``None`` for any other model."""
    head = getattr(model, "score", None)
    if isinstance(head, nn.Module) and type(model).__name__.endswith("ForSequenceClassification"):
        return head
    return None


def last_real_position(ids: torch.Tensor | None, mask: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """``(B,)`` index of the position an un-prompted decoder classifier reads: the rightmost
    ``ids`` entry unlike ``pad_id`` (transformers' rule), or without ids or pad id the
    rightmost attended position."""
    real = (ids != pad_id) if ids is not None and pad_id is not None else mask.bool()   # (B, T)
    positions = torch.arange(real.shape[1], device=real.device)
    return (positions * real.to(positions.dtype)).argmax(-1)


def input_embeddings(model: nn.Module, what: str) -> tuple[str, nn.Module]:
    """``(path, module)`` of the model's token embedding table.

    Args:
        model: A transformers model (``get_input_embeddings``).
        what: The method named in errors.

    Raises:
        RankwiseError: If the model has no input embeddings (one line naming the fix).
    """
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except NotImplementedError:
        emb = None
    if isinstance(emb, PromptLayer):
        emb = emb.base_layer
    if not isinstance(emb, nn.Embedding):
        raise RankwiseError(f"{what} needs a model with input token embeddings "
                            f"(get_input_embeddings() gives {type(emb).__name__}); use a weight "
                            "method such as lora for this model")
    path = next(p for p, m in model.named_modules() if m is emb or getattr(m, "base_layer", None) is emb)
    return path, emb


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's position embeddings allow (``None`` if unknown)."""
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class PromptLayer(Unmergeable, nn.Module):
    """Wraps ``nn.Embedding``; holds one named prompt generator (see the module docstring).

    Args:
        base_layer: The model's input embeddings (never modified).
    """

    adapters_attr = "prompts"
    adapter_kind = "prompt"
    unmergeable_reason = ("virtual tokens are extra input positions, not a weight change; export "
                          "with --format rankwise (or --format peft for prompt-tuning)")

    def __init__(self, base_layer: nn.Embedding) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.prompts = nn.ModuleDict()
        self._active: list[str] = []
        self._pool_at: torch.Tensor | None = None   # (B,) position the score hook moves to -1

    def add(self, name: str, generator: nn.Module) -> nn.Module:
        """Add generator ``name`` and make it active.

        Raises:
            RankwiseError: If the model already has a prompt adapter (one per model).
        """
        if len(self.prompts):
            raise RankwiseError(f"the model already has prompt adapter {next(iter(self.prompts))!r}; "
                                "one prompt adapter per model (delete it first)")
        generator.train(self.base_layer.training)
        self.prompts[name] = generator
        self._active = [name]
        return generator

    # ----- AdapterModule protocol -----------------------------------------------------------
    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """The generator's parameters by name (``prompt_embeddings`` for prompt tuning)."""
        return dict(self.prompts[name].named_parameters())

    def set_active(self, names: list[str]) -> None:
        """Use ``names`` (``[]`` leaves every batch unchanged: the base model)."""
        self._active = [n for n in names if n in self.prompts]
        for n, g in self.prompts.items():
            if hasattr(g, "active"):  # generators with block hooks (CaPT) switch them too
                g.active = n in self._active

    def delete(self, name: str) -> None:
        """Remove adapter ``name`` (and any hooks its generator placed)."""
        detach = getattr(self.prompts[name], "detach", None)
        if callable(detach):
            detach()
        del self.prompts[name]
        self._forget(name)

    def describe(self, name: str) -> dict[str, Any]:
        """Protocol capability: the generator's structure (``num_virtual_tokens``, widths)."""
        return self.prompts[name].describe()

    def statistics(self) -> dict[str, Any]:
        """Protocol capability: router load of generators that route (PT-MoE)."""
        return {n: g.stats.as_dict() for n, g in self.prompts.items() if hasattr(g, "stats")}

    def reset_statistics(self, modes: tuple[str, ...] = ("train", "eval")) -> None:
        """Protocol capability: forget the load sums of ``modes``."""
        for g in self.prompts.values():
            if hasattr(g, "stats"):
                g.stats.reset(modes)

    # ----- InputAdapter protocol -------------------------------------------------------------
    def virtual_tokens(self) -> int:
        """Positions added in front of every sequence (0 when inactive)."""
        return sum(self.prompts[n].num_tokens for n in self._active)

    def transform_inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch with the prefix in front (see the module docstring).

        Raises:
            RankwiseError: For packed batches (``position_ids``), or when prefix plus sequence
                exceed the model's positions.
        """
        if not self._active or ("input_ids" not in batch and "inputs_embeds" not in batch):
            return batch
        out = dict(batch)
        ids, embeds = out.pop("input_ids", None), out.pop("inputs_embeds", None)
        if embeds is None:
            embeds = self.base_layer(ids)
        b, t = embeds.shape[:2]
        v = self.virtual_tokens()
        if "position_ids" in out:
            raise RankwiseError("virtual tokens cannot prefix packed sequences (each packed example "
                                "would need its own prompt); set data.packing: false")
        limit = max_positions(model)
        if limit is not None and v + t > limit:
            raise RankwiseError(f"{v} virtual tokens + {t} tokens exceed the model's {limit} positions; "
                                f"lower data.max_length to {limit - v} or method.num_virtual_tokens")
        mask = out.get("attention_mask")
        mask = torch.ones(b, t, dtype=torch.long, device=embeds.device) if mask is None else mask
        head = sequence_score_head(model)
        if head is not None:                         # read the last real token, not padding
            pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
            self._pool_at = v + last_real_position(ids, mask, pad_id)
            if not head.__dict__.get(_POOL_HOOKED):
                head.register_forward_hook(self._read_last_real)
                object.__setattr__(head, _POOL_HOOKED, True)
        labels = out.get("labels")
        prefix = self.prompts[self._active[0]](embeds, mask, labels)             # (B, v, hidden)
        out["inputs_embeds"] = torch.cat([prefix.to(embeds.dtype), embeds], dim=1)  # (B, v+T, hidden)
        out["attention_mask"] = torch.cat([mask.new_ones(b, v), mask], dim=1)
        if "token_type_ids" in out:
            out["token_type_ids"] = torch.cat([out["token_type_ids"].new_zeros(b, v),
                                               out["token_type_ids"]], dim=1)
        if labels is not None and labels.dim() == 2 and labels.shape[1] == t:  # causal LM targets
            first_off = labels.clone()
            first_off[:, 0] = IGNORE_INDEX
            out["labels"] = torch.cat([labels.new_full((b, v), IGNORE_INDEX), first_off], dim=1)
        return out

    def _read_last_real(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """Forward hook of a decoder classifier's ``score``: the logits of the position
        recorded by :meth:`transform_inputs` go to the last position (used once)."""
        at, self._pool_at = self._pool_at, None
        if at is None or not torch.is_tensor(output) or output.dim() != 3 or output.shape[0] != at.shape[0]:
            return None
        rows = torch.arange(output.shape[0], device=output.device)
        picked = output[rows, at.to(output.device)]                               # (B, C)
        return torch.cat([output[:, :-1], picked.unsqueeze(1)], dim=1)            # (B, v+T, C)

    # ----- the embedding table, unchanged ------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The base embedding lookup (the prefix is added by :meth:`transform_inputs`)."""
        return self.base_layer(input_ids)

    @property
    def weight(self) -> torch.Tensor:
        """The embedding matrix (tied output heads and transformers utilities read it)."""
        return self.base_layer.weight

    @property
    def num_embeddings(self) -> int:
        """Vocabulary size."""
        return self.base_layer.num_embeddings

    @property
    def embedding_dim(self) -> int:
        """Hidden size."""
        return self.base_layer.embedding_dim

    @property
    def padding_idx(self) -> int | None:
        """The base table's padding index."""
        return self.base_layer.padding_idx
