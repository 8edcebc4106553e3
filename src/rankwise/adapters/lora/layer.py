"""The LoRA layer: ``y = W x + s * B A x`` (Hu et al. 2021, eq. 3), with rsLoRA's scale, and
DoRA's magnitude-direction form per adapter (Liu et al. 2024, eq. 5; see :mod:`.dora`).

Wraps ``nn.Linear`` (including bitsandbytes' 4-bit and 8-bit linears, which subclass it) or
transformers' ``Conv1D`` (weight stored (in, out), i.e. fan-in/fan-out transposed) and holds any
number of named adapters. The factors are float32 whatever the base's dtype (bf16, fp16,
4-bit): they are the master weights the optimizer updates; autocast picks the compute dtype.

Inits that move part of ``W`` into the adapter (PiSSA, OLoRA, CorDA: ``adapters/lora/inits.py``)
keep the base untouched and hold their initial factors ``A0, B0`` as frozen buffers
(:meth:`LoraLayer.set_initial`): the layer computes ``(W - s B0 A0) x + s B A x``, i.e. the
residual base of the paper, its merge adds ``s (B A - B0 A0)``, and the saved adapter (which
holds ``A0, B0``) applies to the original base - so a run resumes, reloads and exports onto the
weights it was loaded from.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.adapters.common.factors import LORA_INITS, check_rank, lora_scale
from rankwise.adapters.lora import dora, fused
from rankwise.core import weights as layer_weights
from rankwise.core.inject import is_conv1d
from rankwise.core.protocol import NamedAdapters
from rankwise.core.weights import is_quantized
from rankwise.errors import RankwiseError


class LoraLayer(NamedAdapters, nn.Module):
    """A linear layer with named low-rank adapters (``AdapterModule``).

    Args:
        base_layer: ``nn.Linear`` or ``Conv1D`` to wrap; its weights are not modified except
            by :meth:`merge`.

    Raises:
        RankwiseError: If ``base_layer`` is not a supported layer type.
    """

    adapters_attr = "lora_A"
    fused_lora = False  # train.fused_lora: take the fused path (:mod:`.fused`) where it applies

    @staticmethod
    def fuse_model(model: nn.Module, on: bool) -> int:
        """``train.fused_lora``'s model-wide part, called once per run by the session for the
        classes that carry the ``fused_lora`` switch: the gated-MLP node of :mod:`.fused_mlp`
        installed (``on``) or removed.

        Returns:
            How many MLP modules have the node now.
        """
        from rankwise.adapters.lora import fused_mlp
        return fused_mlp.install(model, on)

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        if isinstance(base_layer, nn.Linear):
            self.fan_in_fan_out = False
            self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        elif is_conv1d(base_layer):
            self.fan_in_fan_out = True
            self.in_features, self.out_features = base_layer.weight.shape
        else:
            raise RankwiseError(f"LoRA supports nn.Linear and Conv1D, got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.lora_initial = nn.ModuleDict()  # name -> frozen (A0, B0) buffers, see set_initial
        self.requantized: set[str] = set()  # adapters whose init re-quantized the base (LoftQ)
        self.scaling: dict[str, float] = {}
        self.ranks: dict[str, int] = {}
        self.alphas: dict[str, float] = {}
        self.rslora: dict[str, bool] = {}
        # DoRA adapters: magnitude m (out,) per adapter, PEFT's name; the factor m / ||W + sBA||
        # each merged one was merged with (to unmerge exactly); ||W_i||^2 of the base, cached
        # with the identity of the storage it was read from (recomputed if that changes).
        self.lora_magnitude_vector = nn.ParameterDict()
        self._dora_merged: dict[str, torch.Tensor] = {}
        self._w_sq: tuple[tuple, torch.Tensor] | None = None
        self._active: list[str] = []
        self._merged: list[str] = []

    # ----- construction -------------------------------------------------------------------
    def add(self, name: str, r: int, alpha: float, dropout: float = 0.0,
            use_rslora: bool = False, init: str = "kaiming", use_dora: bool = False) -> None:
        """Add adapter ``name`` of rank ``r`` and make it active.

        With ``use_dora`` the adapter is DoRA's (Liu et al. 2024): a magnitude ``m`` (out,),
        float32, initialised to the row norms of ``W + s B A`` so the output is unchanged.

        Raises:
            RankwiseError: If ``r`` is outside [1, min(in, out)] or ``init`` is unknown.
        """
        check_rank(r, self.in_features, self.out_features)
        if init not in LORA_INITS:
            raise RankwiseError(f"unknown LoRA init {init!r}; expected one of {sorted(LORA_INITS)}")
        device = self.base_layer.weight.device
        a = nn.Linear(self.in_features, r, bias=False, device=device, dtype=torch.float32)
        b = nn.Linear(r, self.out_features, bias=False, device=device, dtype=torch.float32)
        LORA_INITS[init](a, b)
        self.lora_A[name], self.lora_B[name] = a, b
        self.lora_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling[name] = lora_scale(r, alpha, use_rslora)
        self.ranks[name], self.alphas[name], self.rslora[name] = r, alpha, use_rslora
        if use_dora:
            self.lora_magnitude_vector[name] = nn.Parameter(self._dora_norm(name))
        if name not in self._active:
            self._active.append(name)

    def set_initial(self, name: str, a: torch.Tensor, b: torch.Tensor, residual: bool) -> None:
        """Set adapter ``name``'s factors to ``a (r, in)``, ``b (out, r)``; with ``residual``,
        also keep them as the frozen pair ``A0, B0`` that the layer subtracts (``s B0 A0``),
        so the output at init is the base's and the base weights stay as loaded."""
        with torch.no_grad():
            self.lora_A[name].weight.copy_(a)
            self.lora_B[name].weight.copy_(b)
        if residual:
            pair = nn.Module()
            # row-major like a loaded file's (SVD returns column-major U: other matmul kernels)
            pair.register_buffer("A", a.detach().float().clone(memory_format=torch.contiguous_format))
            pair.register_buffer("B", b.detach().float().clone(memory_format=torch.contiguous_format))
            self.lora_initial[name] = pair

    def adapter_buffers(self, name: str) -> dict[str, torch.Tensor]:
        """Frozen tensors saved with adapter ``name``: ``{"lora_A0.weight", "lora_B0.weight"}``
        of a residual init (see :meth:`set_initial`), else ``{}``."""
        if name not in self.lora_initial:
            return {}
        pair = self.lora_initial[name]
        return {"lora_A0.weight": pair.A, "lora_B0.weight": pair.B}

    def delta_factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A', B')`` with ``s B' A'`` the adapter's whole delta on the original base: ``(A, B)``,
        or for a residual init the rank-2r ``([A; A0], [B, -B0])`` (PEFT's conversion of
        PiSSA/OLoRA/CorDA, ``path_initial_model_for_weight_conversion``). Detached."""
        a, b = (t.detach() for t in self.factors(name))
        if name in self.lora_initial:
            pair = self.lora_initial[name]
            a, b = torch.cat([a, pair.A], 0), torch.cat([b, -pair.B], 1)
        return a, b

    # ----- AdapterModule protocol -----------------------------------------------------------
    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """Return ``{"lora_A.weight": A, "lora_B.weight": B}`` for adapter ``name`` (and DoRA's
        ``"lora_magnitude_vector": m``, PEFT's file key)."""
        out = {"lora_A.weight": self.lora_A[name].weight, "lora_B.weight": self.lora_B[name].weight}
        if name in self.lora_magnitude_vector:
            out["lora_magnitude_vector"] = self.lora_magnitude_vector[name]
        return out

    def factors(self, name: str) -> tuple[nn.Parameter, nn.Parameter]:
        """Protocol capability: ``(A (r, in), B (out, r))`` of adapter ``name``."""
        return self.lora_A[name].weight, self.lora_B[name].weight

    def describe(self, name: str) -> dict:
        """Protocol capability: ``{"r", "alpha", "use_rslora"}`` of adapter ``name`` (plus its
        derived ``scale``, for summaries, and ``use_dora: true`` for a DoRA adapter)."""
        out = {"r": self.ranks[name], "alpha": self.alphas[name],
               "use_rslora": self.rslora.get(name, False), "scale": self.scaling[name]}
        if name in self.lora_magnitude_vector:
            out["use_dora"] = True
        return out

    def is_dora(self, name: str) -> bool:
        """True if adapter ``name`` is a DoRA adapter (it has a magnitude vector)."""
        return name in self.lora_magnitude_vector

    def delta_weight(self, name: str) -> torch.Tensor:
        """Return s * B A in the base weight's layout ((out, in), or (in, out) for Conv1D)."""
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        delta = (b.float() @ a.float()) * self.scaling[name]  # (out, in)
        if name in self.lora_initial:  # the residual base: - s B0 A0
            pair = self.lora_initial[name]
            delta = delta - (pair.B @ pair.A) * self.scaling[name]
        return delta.T if self.fan_in_fan_out else delta

    def _add_to_base(self, delta: torch.Tensor) -> None:
        """``W += delta``, summed in float32 and rounded once for a low-precision ``W``."""
        w = self.base_layer.weight
        with torch.no_grad():
            if w.dtype == torch.float32:
                w.add_(delta)
            else:
                w.copy_((w.float() + delta).to(w.dtype))

    def merge(self, name: str) -> None:
        """Add s * B A to the base weight (skips an adapter that is already merged); a DoRA
        adapter replaces W by ``m / ||W0 + s B A||_row ⊙ (W + s B A)`` (W0: the base with every
        earlier merge undone, the weight its forward normalises).

        Raises:
            RankwiseError: If the base layer is quantized: adding to packed 4/8-bit codes would
                re-quantize the sum; the merged export dequantizes first.
        """
        if name in self._merged:
            return
        if is_quantized(self.base_layer):
            raise RankwiseError(f"cannot merge into a quantized {type(self.base_layer).__name__} "
                                "in place; export with --format merged (rankwise.export_merged), "
                                "which merges into the dequantized base")
        if self.is_dora(name):
            w = layer_weights.dense_weight(self.base_layer).float()            # (out, in)
            a, b = self.lora_A[name].weight, self.lora_B[name].weight
            norm = dora.row_norms_direct(self._unmerged(w), a, b, self.scaling[name])
            factor = (self.lora_magnitude_vector[name].detach().float() / norm)[:, None]
            self._dora_merged[name] = factor                                    # (out, 1)
            self._set_base((w + self.scaling[name] * (b.float() @ a.float())) * factor)
        else:
            self._add_to_base(self.delta_weight(name))
        self._merged.append(name)

    def _unmerged(self, w: torch.Tensor) -> torch.Tensor:
        """The float32 ``(out, in)`` weight ``w`` with every merged adapter undone (a copy)."""
        w = w.clone()
        for name in reversed(self._merged):
            delta = self.delta_weight(name)
            delta = delta.T if self.fan_in_fan_out else delta                 # (out, in)
            w = w / self._dora_merged[name] - delta if self.is_dora(name) else w - delta
        return w

    def _set_base(self, w: torch.Tensor) -> None:
        """Store the float32 ``(out, in)`` ``w`` as the base weight (rounded once)."""
        target = self.base_layer.weight
        with torch.no_grad():
            target.copy_(layer_weights.to_storage_layout(self.base_layer, w).to(target.dtype))
        self._w_sq = None

    def unmerge(self) -> None:
        """Subtract every merged adapter's delta (divide by a DoRA adapter's factor first),
        newest first."""
        while self._merged:
            name = self._merged.pop()
            if self.is_dora(name):
                delta = self.delta_weight(name)
                delta = delta.T if self.fan_in_fan_out else delta             # (out, in)
                w = layer_weights.dense_weight(self.base_layer).float()
                self._set_base(w / self._dora_merged.pop(name) - delta)
            else:
                self._add_to_base(-self.delta_weight(name))

    def delete(self, name: str) -> None:
        """Remove adapter ``name`` (unmerging first if needed)."""
        if name in self._merged:
            self.unmerge()
        for d in (self.lora_A, self.lora_B, self.lora_dropout):
            del d[name]
        if name in self.lora_initial:
            del self.lora_initial[name]
        if name in self.lora_magnitude_vector:
            del self.lora_magnitude_vector[name]
        for d in (self.scaling, self.ranks, self.alphas, self.rslora):
            d.pop(name, None)
        self.requantized.discard(name)
        self._forget(name)

    # ----- compute ------------------------------------------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        """The base weight (so code that reads ``layer.weight`` keeps working)."""
        return self.base_layer.weight

    def _dora_norm(self, name: str) -> torch.Tensor:
        """``||W + s B A||_row`` (out,) of adapter ``name``, float32, no gradient, by the
        expansion of :mod:`.dora` (``||W_i||²`` cached while the base storage is unchanged)."""
        w = self.base_layer.weight
        key = (id(w), w.device, w.dtype, w.data_ptr(), w._version, type(self.base_layer))
        if self._w_sq is None or self._w_sq[0] != key:
            self._w_sq = (key, dora.weight_sq_norms(self.base_layer))
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        wa = dora.weight_times(self.base_layer, a)                              # (out, r)
        return dora.row_norms(self._w_sq[1], wa, a, b, self.scaling[name],
                              dense=lambda: layer_weights.dense_weight(self.base_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``W x + sum_active s_i B_i A_i dropout(x)``; merged adapters are already in W.

        The low-rank term is added into the base output in place with one fused
        ``add_(delta, alpha=s)`` (no separate scale and sum tensors); that is safe for autograd
        because a linear layer's backward never reads its own output. An output that is a view
        (an autograd Function returned it reshaped) gets an out-of-place sum instead. Casts and
        the dropout call happen only when needed.

        A DoRA adapter gives ``f ⊙ (out - b + s B A x) + b`` with ``f = m / ||W + s B A||_row``
        (the norm detached). With dropout active in training it follows PEFT:
        ``out + (f - 1) ⊙ W x_d + f ⊙ s B A x_d`` for the dropped-out input ``x_d``.
        """
        if self.fused_lora and (one := fused.eligible(self, x)) is not None:
            return fused.forward(self, x, one)
        out = self.base_layer(x)
        for name in self._active:
            if name in self._merged:
                continue
            a, b = self.lora_A[name].weight, self.lora_B[name].weight
            h = x if x.dtype == a.dtype else x.to(a.dtype)
            drop = self.lora_dropout[name]
            dropped = not isinstance(drop, nn.Identity) and self.training
            if not isinstance(drop, nn.Identity):
                h = drop(h)
            delta = F.linear(F.linear(h, a), b)  # (..., r) then (..., out)
            if name in self.lora_initial:  # residual base (W - s B0 A0) x, never dropped out
                pair = self.lora_initial[name]
                x0 = x if x.dtype == pair.A.dtype else x.to(pair.A.dtype)
                delta = delta - F.linear(F.linear(x0, pair.A), pair.B)
            delta = delta if delta.dtype == out.dtype else delta.to(out.dtype)
            if self.is_dora(name):
                factor = (self.lora_magnitude_vector[name] / self._dora_norm(name)).to(out.dtype)
                bias = getattr(self.base_layer, "bias", None)
                if not dropped:
                    out = dora.combine(out, delta, self.scaling[name], factor, bias)
                    continue
                wx = self.base_layer(h.to(x.dtype))                            # W x_d + b
                wx = wx - bias.to(wx.dtype) if bias is not None else wx
                out = out + (factor - 1) * wx + factor * (delta * self.scaling[name])
            elif torch.compiler.is_compiling() or out._is_view():  # bitsandbytes' 8-bit matmul
                # returns a view of its result; under torch.compile the in-place add would break
                # the graph (``_is_view`` is not traceable) and the fused add costs the same
                out = out + delta * self.scaling[name]
            else:
                out = out.add_(delta, alpha=self.scaling[name])
        return out

    def extra_repr(self) -> str:
        return ", ".join(f"{n}: r={self.ranks[n]}, s={self.scaling[n]:.3g}"
                         + (", dora" if self.is_dora(n) else "") for n in self.adapter_names())
