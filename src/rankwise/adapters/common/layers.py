"""The bookkeeping of an adapter layer that wraps a linear-like base layer and cannot be merged.

LoPE, FVAE-LoRA, S'MoRE and the LoRA mixtures each keep their adapters in one ``ModuleDict``
keyed by adapter name, the settings that rebuild each adapter, the active names and the
auxiliary losses of the last forward; :class:`UnmergeableLayer` holds that once. A subclass
names its container (``adapters_attr``), builds its adapter module in ``add`` and hands it to
:meth:`UnmergeableLayer.hold`, and implements ``adapter_params`` and ``describe``. The default
``forward`` adds each active adapter's output on the flattened float32 tokens (FVAE-LoRA,
S'MoRE); LoPE and the mixtures override it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rankwise.core import weights as layer_weights
from rankwise.core.protocol import Unmergeable


class UnmergeableLayer(Unmergeable, nn.Module):
    """A linear-like layer with named, unmergeable adapters (``AdapterModule`` bookkeeping).

    Args:
        base_layer: ``nn.Linear``, ``Conv1D`` or a quantized linear (anything
            :func:`rankwise.core.weights.shape` reads); never modified.

    Attributes:
        base_layer: The wrapped layer.
        out_features, in_features: Its logical shape.
        settings: ``{adapter name: settings}`` (what ``describe`` reports, by default).
    """

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.out_features, self.in_features = layer_weights.shape(base_layer)
        setattr(self, self.adapters_attr, nn.ModuleDict())
        self.settings: dict[str, dict[str, Any]] = {}
        self._active: list[str] = []
        self._aux: dict[str, torch.Tensor] = {}
        self.train(base_layer.training)  # a new layer follows the model's mode

    def hold(self, name: str, adapter: nn.Module, settings: dict[str, Any]) -> nn.Module:
        """Keep ``adapter`` as adapter ``name`` (in this layer's train/eval mode) with the
        ``settings`` that rebuild it, and make it active.

        Returns:
            ``adapter``.
        """
        adapter.train(self.training)
        getattr(self, self.adapters_attr)[name] = adapter
        self.settings[name] = settings
        if name not in self._active:
            self._active.append(name)
        return adapter

    def delete(self, name: str) -> None:
        """Remove adapter ``name``."""
        del getattr(self, self.adapters_attr)[name]
        self.settings.pop(name, None)
        self._forget(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``W0 x`` plus every active adapter's output on the tokens ``x (N, in)`` in float32,
        for adapters that map tokens to output rows; each adapter's ``last_aux`` is summed into
        :meth:`aux_losses`. Layers whose adapters work otherwise override it."""
        out = self.base_layer(x)
        self._aux = {}
        if not self._active:
            return out
        flat = x.reshape(-1, self.in_features).float()                     # (N, in)
        adapters = getattr(self, self.adapters_attr)
        for name in self._active:
            adapter = adapters[name]
            out = out + adapter(flat).reshape(out.shape).to(out.dtype)    # (..., out)
            self.add_aux(getattr(adapter, "last_aux", {}))
        return out

    def add_aux(self, aux: dict[str, torch.Tensor]) -> None:
        """Add one adapter's auxiliary losses of this forward to the layer's sums."""
        for key, value in aux.items():
            self._aux[key] = self._aux[key] + value if key in self._aux else value

    def aux_losses(self) -> dict[str, torch.Tensor]:
        """Protocol capability: the auxiliary losses of the last forward (none by default)."""
        return dict(self._aux)
