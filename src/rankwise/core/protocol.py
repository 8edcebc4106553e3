"""The ``AdapterModule`` protocol: what an adapter layer is and what it can do.

Freezing, counting, saving, merging, switching and loss collection all go through this
protocol, never through a parameter-name prefix (HF PEFT's prefix matching once misclassified
base modules). Besides the required methods, a layer declares *capabilities*; the functions
below read them with defaults, so a new method implements only what it has:

==================  =============================================================  ==========
capability          meaning                                                        default
==================  =============================================================  ==========
``mergeable``       class attribute: ``merge`` folds the adapter into the base       ``True``
                    weight exactly (a router-weighted mixture cannot)
``aux_losses()``    ``{name: weighted loss}`` computed in the last forward            none
                    (load balance, ELBO terms); the training engine adds them
``factors(name)``   the low-rank pair ``(A (r, in), B (out, r))`` of adapter          ``None``
                    ``name`` (LoRA-shaped layers; used by AltLoRA, RoLoRA, ...)
``describe(name)``  JSON structure that, with the method config, rebuilds the         ``{}``
                    adapter on this layer (per-layer ranks, expert counts)
``statistics()``    JSON counters of the layer's routers (expert load per mode);      none
                    ``reset_statistics(modes)`` clears them. Written to the run
                    folder by :class:`rankwise.engine.adapter_stats.AdapterStatistics`
``unmergeable_``    class attribute: one clause saying why ``merge`` is refused and   generic
``reason``          what to export instead (used by ``check_mergeable``)
``merges_on_grid``  class attribute: ``merge`` works on the layer's own quantized     ``False``
                    base (LoTA-QAF moves integer codes), so the merged export merges
                    before it dequantizes (``core.merged``)
==================  =============================================================  ==========

Whole-model input adapters (prompt tuning: virtual tokens in front of the sequence) implement
:class:`InputAdapter` instead; :func:`transform_inputs` applies them to a batch, and
:func:`attach_input_hook` makes the model's own forward (``model(...)``, ``generate``, HF
``Trainer``) apply them too. Both are one mechanism: the hook calls :func:`transform_inputs`,
and leaves alone a batch that :func:`transform_inputs` already made, so the engine (which needs
the extended labels for its own loss) transforms explicitly and nothing is prefixed twice.
"""
from __future__ import annotations

import inspect
import weakref
from typing import Any, Iterator, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class AdapterModule(Protocol):
    """A module that wraps ``base_layer`` and adds one or more named adapters.

    Attributes:
        base_layer: The wrapped original module (its weights are the frozen base).
    """

    base_layer: nn.Module

    def adapter_names(self) -> list[str]:
        """Return the names of the adapters this layer holds."""
        ...

    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """Return adapter ``name``'s parameters by a key relative to this layer.

        Keys are stable file keys (e.g. ``"lora_A.weight"``); values are the live parameters.
        """
        ...

    def set_active(self, names: list[str]) -> None:
        """Make ``names`` the adapters used in ``forward`` (an empty list disables all)."""
        ...

    def active_names(self) -> list[str]:
        """Return the adapters currently used in ``forward``."""
        ...

    def merge(self, name: str) -> None:
        """Fold adapter ``name`` into ``base_layer``'s weight (exact; reversible by unmerge)."""
        ...

    def unmerge(self) -> None:
        """Undo every merge, restoring the base weight."""
        ...

    def delete(self, name: str) -> None:
        """Remove adapter ``name`` from this layer."""
        ...


@runtime_checkable
class InputAdapter(Protocol):
    """A module that changes the model's *input* (e.g. virtual tokens in front of it).

    It is an :class:`AdapterModule` for saving and counting; in addition, before every
    forward the engine (and generation) passes the batch through :meth:`transform_inputs`.
    """

    def transform_inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return the batch the model should see (``inputs_embeds`` with the prefix, the
        attention mask and labels extended by ``virtual_tokens()`` positions)."""
        ...

    def virtual_tokens(self) -> int:
        """Positions added in front of every sequence (0 when inactive)."""
        ...


class NamedAdapters:
    """The protocol's bookkeeping for a layer that keeps its adapters in one container keyed by
    adapter name (a ``ModuleDict`` or ``ParameterDict``, named by ``adapters_attr``) and the
    active names in ``self._active``: ``adapter_names``, ``set_active``, ``active_names``.
    Mix it in before ``nn.Module``; the layer implements the rest of :class:`AdapterModule`.
    """

    adapters_attr: str = ""
    _active: list[str]

    def adapter_names(self) -> list[str]:
        """The adapter names held by this layer."""
        return list(getattr(self, self.adapters_attr).keys())

    def set_active(self, names: list[str]) -> None:
        """Use ``names`` in forward (unknown names are ignored; ``[]`` gives the base layer)."""
        held = getattr(self, self.adapters_attr)
        self._active = [n for n in names if n in held]

    def active_names(self) -> list[str]:
        """The active adapter names."""
        return list(self._active)

    def _forget(self, name: str) -> None:
        """Drop ``name`` from the active names (after deleting its tensors)."""
        self._active = [n for n in self._active if n != name]


class Unmergeable(NamedAdapters):
    """:class:`NamedAdapters` for a layer whose adapter is not a weight delta (routed or
    input-dependent): ``mergeable = False``, ``merge`` refuses with ``unmergeable_reason``, and
    ``unmerge`` is a no-op so disabling adapters still works."""

    mergeable = False
    adapter_kind = "this"
    unmergeable_reason = "it is not a fixed weight change; keep it as an adapter: export with --format rankwise"

    def merge(self, name: str) -> None:
        """Refuse.

        Raises:
            RankwiseError: Always (``rankwise.core.merge_adapters`` checks ``mergeable`` first).
        """
        from rankwise.errors import RankwiseError
        raise RankwiseError(f"{self.adapter_kind} adapter {name!r} cannot be merged into the base "
                            f"weight ({self.unmergeable_reason})")

    def unmerge(self) -> None:
        """Nothing is ever merged."""


def adapter_modules(model: nn.Module) -> Iterator[tuple[str, AdapterModule]]:
    """Yield ``(path, module)`` for every adapter module in ``model`` (outermost first).

    Args:
        model: Any module.

    Yields:
        The dotted path of each adapter module and the module.
    """
    for path, module in model.named_modules():
        if isinstance(module, AdapterModule) and isinstance(getattr(module, "base_layer", None), nn.Module):
            yield path, module


def is_mergeable(module: AdapterModule) -> bool:
    """The ``mergeable`` capability (default True)."""
    return bool(getattr(module, "mergeable", True))


def merges_on_grid(module: AdapterModule) -> bool:
    """The ``merges_on_grid`` capability (default False)."""
    return bool(getattr(module, "merges_on_grid", False))


def factors(module: AdapterModule, name: str) -> tuple[nn.Parameter, nn.Parameter] | None:
    """The ``factors`` capability: ``(A, B)`` of adapter ``name``, or None."""
    fn = getattr(module, "factors", None)
    return fn(name) if callable(fn) else None


def describe(module: AdapterModule, name: str) -> dict[str, Any]:
    """The ``describe`` capability: the JSON structure of adapter ``name`` on this layer."""
    fn = getattr(module, "describe", None)
    return dict(fn(name)) if callable(fn) else {}


def aux_losses(model: nn.Module) -> dict[str, torch.Tensor]:
    """Sum, per name, the auxiliary losses every module reported in the last forward.

    Args:
        model: The adapted model, right after a training forward.

    Returns:
        ``{name: 0-dim tensor}`` (already weighted by each method's own coefficient); empty
        when no module reports any.
    """
    out: dict[str, torch.Tensor] = {}
    for module in model.modules():
        fn = getattr(module, "aux_losses", None)
        if not callable(fn) or isinstance(module, type):
            continue
        for key, value in (fn() or {}).items():
            out[key] = out[key] + value if key in out else value
    return out


def statistics(model: nn.Module) -> dict[str, Any]:
    """The ``statistics`` capability of every adapter layer that reports any.

    Args:
        model: The adapted model.

    Returns:
        ``{layer path: layer.statistics()}`` for layers whose statistics are non-empty.
    """
    out = {}
    for path, module in adapter_modules(model):
        fn = getattr(module, "statistics", None)
        stats = fn() if callable(fn) else None
        if stats:
            out[path] = stats
    return out


def reset_statistics(model: nn.Module, modes: tuple[str, ...] = ("train", "eval")) -> None:
    """Clear the ``modes`` counters of every adapter layer with ``reset_statistics``."""
    for _, module in adapter_modules(model):
        fn = getattr(module, "reset_statistics", None)
        if callable(fn):
            fn(modes)


def input_adapters(model: nn.Module) -> list[InputAdapter]:
    """Every module of ``model`` that transforms the input."""
    return [m for m in model.modules() if isinstance(m, InputAdapter) and m is not model]


# The main input tensor of every batch transform_inputs changed, by id (weakly held: an entry
# goes with its tensor). The model's input hook passes such a batch through untouched.
_TRANSFORMED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _main_input(batch: dict[str, Any]) -> Any:
    embeds = batch.get("inputs_embeds")
    return embeds if embeds is not None else batch.get("input_ids")


def transform_inputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pass ``batch`` through every :class:`InputAdapter` of ``model`` (unchanged if none).

    The result is remembered (by its ``inputs_embeds`` / ``input_ids`` tensor), so the model's
    input hook (:func:`attach_input_hook`) does not transform it a second time.
    """
    before = _main_input(batch)
    for adapter in input_adapters(model):
        batch = adapter.transform_inputs(model, batch)
    after = _main_input(batch)
    if isinstance(after, torch.Tensor) and after is not before:
        _TRANSFORMED[id(after)] = after
    return batch


def _cached_length(kwargs: dict[str, Any]) -> int:
    """Positions already in the KV cache of a forward call (0: a first, uncached forward)."""
    for key in ("cache", "past_key_values"):  # transformers 5 renamed past_key_values to cache
        cache = kwargs.get(key)
        if cache is None:
            continue
        length = getattr(cache, "get_seq_length", None)
        if callable(length):
            return int(length())
        if isinstance(cache, (tuple, list)) and cache and cache[0] is not None:  # legacy tuples
            return int(cache[0][0].shape[-2])
    return 0


class InputHook:
    """Forward pre-hook (with kwargs) on the top model that applies its input adapters, so a
    plain ``model(input_ids=..., labels=...)`` (HF ``Trainer``, a user's loop) and
    ``model.generate`` see the virtual tokens exactly as the engine does.

    * A first (uncached) forward goes through :func:`transform_inputs` (with an all-ones
      attention mask if the call has none): the prefix in front, attention mask and labels
      extended. ``position_ids`` (``generate`` passes them) are set aside and come back shifted
      by the ``v`` virtual positions; restarting (packed) positions are refused.
    * A cached step (``generate`` after its first step: the cache holds the prefix) only gets the
      ``v`` positions the caller does not know about: ones in front of a 2-D attention mask that
      covers just the real tokens, and ``position_ids`` / ``cache_position`` shifted by ``v``.
    * A batch :func:`transform_inputs` already made (the engine's) passes unchanged.
    """

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        adapters = input_adapters(model)
        v = sum(a.virtual_tokens() for a in adapters)
        if not v:
            return None
        if args:  # positional inputs by the forward's parameter names (input_ids first)
            names = [p.name for p in inspect.signature(model.forward).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            kwargs = {**dict(zip(names, args)), **kwargs}
        main = _main_input(kwargs)
        if main is None or _TRANSFORMED.get(id(main)) is main:
            return (), kwargs
        past = _cached_length(kwargs)
        if past:
            return (), _cached_step(kwargs, v, past)
        out = dict(kwargs)
        if out.get("attention_mask") is None:  # generate drops an all-ones mask; adapters get one
            out["attention_mask"] = torch.ones(main.shape[:2], dtype=torch.long, device=main.device)
        positions = out.pop("position_ids", None)
        cache_position = out.pop("cache_position", None)
        out = transform_inputs(model, out)
        if positions is not None:
            if bool((positions.diff(dim=-1) < 0).any()):
                from rankwise.errors import RankwiseError
                raise RankwiseError("virtual tokens cannot prefix packed sequences (restarting "
                                    "position_ids: each packed example would need its own prompt); "
                                    "set data.packing: false")
            front = torch.arange(v, device=positions.device, dtype=positions.dtype)
            out["position_ids"] = torch.cat([front.expand(*positions.shape[:-1], v), positions + v], -1)
        if cache_position is not None:
            out["cache_position"] = torch.arange(v + cache_position.shape[-1], device=cache_position.device)
        return (), out


def _cached_step(kwargs: dict[str, Any], v: int, past: int) -> dict[str, Any]:
    """A cached forward's kwargs with the ``v`` virtual positions the caller left out.

    The caller counts real tokens only (as ``generate`` does) when its 2-D mask, or its last
    position, is ``v`` short of ``past + new``; inputs that already count the prefix pass as
    they are.
    """
    out = dict(kwargs)
    total = past + _main_input(out).shape[1]                      # cache + this step's tokens
    mask = out.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] + v == total:
        out["attention_mask"] = torch.cat([mask.new_ones(mask.shape[0], v), mask], dim=1)
    for key in ("position_ids", "cache_position"):
        pos = out.get(key)
        if isinstance(pos, torch.Tensor) and pos.numel() and int(pos.max()) + 1 + v == total:
            out[key] = pos + v
    return out


def attach_input_hook(model: nn.Module) -> None:
    """Make ``model``'s own forward apply its input adapters (:class:`InputHook`); idempotent.

    Builders of input-adapter methods call it on the model they adapt; without input adapters
    the hook does nothing.
    """
    if not any(isinstance(h, InputHook) for h in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(InputHook(), with_kwargs=True)
