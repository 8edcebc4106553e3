"""LoRA on fused 3-D expert parameters: one low-rank pair per expert, ``W_e + s B_e A_e``.

transformers 5 stores a mixture-of-experts block's experts as 3-D ``nn.Parameter``s of one
module (Qwen3-MoE, Mixtral, OLMoE: ``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` and
``mlp.experts.down_proj`` ``(E, H, I)``), read by the module's own forward (a loop over experts,
``batched_mm`` or ``grouped_mm``). No ``nn.Linear`` exists to wrap, so module targeting never
sees them (PEFT issue #3009). :class:`ExpertLoraLayer` wraps the *module* and adapts some of its
3-D parameters: for expert ``e`` of parameter ``W`` (``(E, out, in)``, or ``(E, in, out)`` when
the module says ``is_transposed``, as GPT-OSS does),

    W'_e = W_e + s B_e A_e,   A (E, r, in),  B (E, out, r),  s = alpha / r (Hu et al. 2021, eq. 3;
                                                               rsLoRA: alpha / sqrt(r))

with ``B = 0`` at init, so the model starts as the base. The forward hands the module its own
forward with the effective weights swapped in (``torch.func.functional_call``): whatever
experts implementation transformers dispatches to, it reads ``W'``, and autograd reaches A and
B through it. This materialises one ``(E, out, in)`` tensor (``W'``, one ``baddbmm``) per
adapted parameter per forward, as PEFT's ``ParamWrapper`` does. Input dropout has no place in
a weight-space delta, so there is none (PEFT refuses it too).

Any LoRA-shaped method can put these layers at the targets of
:func:`rankwise.core.inject.find_parameter_targets` through
:func:`rankwise.adapters.common.build.adapt` (``param_wrap``); LoRA does
(``method.target_parameters``).
"""
from __future__ import annotations

import torch
from torch import nn

from rankwise.adapters.common.factors import LORA_INITS, check_rank, lora_scale
from rankwise.core.protocol import NamedAdapters
from rankwise.errors import RankwiseError

# Inits of the pair that need nothing but the pair's shape (no base weight, no data).
EXPERT_INITS = ("kaiming", "gaussian")


class ExpertLoraLayer(NamedAdapters, nn.Module):
    """A module with 3-D expert parameters and named per-expert LoRA pairs (``AdapterModule``).

    Args:
        base_layer: The module holding the parameters (e.g. ``Qwen3MoeExperts``); its weights
            change only in :meth:`merge`.

    Attributes:
        lora_A: ``{adapter: {parameter: A (E, r, in)}}``, float32.
        lora_B: ``{adapter: {parameter: B (E, out, r)}}``, float32.
        settings: ``{adapter: {parameter: {"r", "alpha", "use_rslora"}}}``.
    """

    adapters_attr = "lora_A"

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.settings: dict[str, dict[str, dict]] = {}
        self.scaling: dict[str, dict[str, float]] = {}
        self._active: list[str] = []
        self._merged: list[str] = []

    # ----- shapes -------------------------------------------------------------------------
    def _param(self, pname: str) -> torch.Tensor:
        return getattr(self.base_layer, pname)

    @property
    def transposed(self) -> bool:
        """True when the module stores ``(E, in, out)`` (transformers' ``is_transposed``)."""
        return bool(getattr(self.base_layer, "is_transposed", False))

    def expert_shape(self, pname: str) -> tuple[int, int, int]:
        """``(experts, out, in)`` of parameter ``pname``.

        Raises:
            RankwiseError: If the module has no 3-D parameter of that name.
        """
        p = getattr(self.base_layer, pname, None)
        if not isinstance(p, torch.Tensor) or p.dim() != 3:
            raise RankwiseError(f"{type(self.base_layer).__name__}.{pname} is not a 3-D expert "
                                "parameter; target linear layers with method.targets instead")
        e, d1, d2 = p.shape
        return (e, d2, d1) if self.transposed else (e, d1, d2)

    # ----- construction -------------------------------------------------------------------
    def add(self, name: str, pname: str, r: int, alpha: float, use_rslora: bool = False,
            init: str = "kaiming") -> None:
        """Add a per-expert pair of rank ``r`` on parameter ``pname`` to adapter ``name`` (and
        make the adapter active).

        A_e and B_e are initialised as LoRA initialises a linear layer's pair of the expert's
        shape (``kaiming``: A Kaiming-uniform, B = 0; ``gaussian``: A ~ N(0, 1/r^2), B = 0).

        Raises:
            RankwiseError: If ``pname`` is not 3-D, ``r`` is outside [1, min(in, out)], or
                ``init`` needs more than the pair's shape.
        """
        experts, n_out, n_in = self.expert_shape(pname)
        check_rank(r, n_in, n_out)
        if init not in EXPERT_INITS:
            raise RankwiseError(f"init {init!r} is not available for expert parameters; use one "
                                f"of {list(EXPERT_INITS)}")
        device = self._param(pname).device
        a = torch.empty(experts, r, n_in, device=device, dtype=torch.float32)
        b = torch.empty(experts, n_out, r, device=device, dtype=torch.float32)
        for e in range(experts):  # each expert's pair as LoRA's init makes a linear layer's
            la = nn.Linear(n_in, r, bias=False, device=device, dtype=torch.float32)
            lb = nn.Linear(r, n_out, bias=False, device=device, dtype=torch.float32)
            LORA_INITS[init](la, lb)
            a[e], b[e] = la.weight.detach(), lb.weight.detach()
        if name not in self.lora_A:
            self.lora_A[name], self.lora_B[name] = nn.ParameterDict(), nn.ParameterDict()
            self.settings[name], self.scaling[name] = {}, {}
        self.lora_A[name][pname] = nn.Parameter(a)
        self.lora_B[name][pname] = nn.Parameter(b)
        self.settings[name][pname] = {"r": r, "alpha": alpha, "use_rslora": use_rslora}
        self.scaling[name][pname] = lora_scale(r, alpha, use_rslora)
        if name not in self._active:
            self._active.append(name)

    # ----- AdapterModule protocol -----------------------------------------------------------
    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """``{"lora_A.<parameter>": A, "lora_B.<parameter>": B}`` of adapter ``name``."""
        out = {}
        for pname in self.lora_A[name]:
            out[f"lora_A.{pname}"] = self.lora_A[name][pname]
            out[f"lora_B.{pname}"] = self.lora_B[name][pname]
        return out

    def describe(self, name: str) -> dict:
        """Protocol capability: ``{"parameters": {parameter: {"r", "alpha", "use_rslora"}}}``
        (what rebuilds adapter ``name`` here; the key marks a parameter-targeted layer), plus
        ``r`` and ``scale`` when every parameter shares them (for summaries)."""
        out: dict = {"parameters": {p: dict(s) for p, s in self.settings[name].items()}}
        ranks, scales = {s["r"] for s in self.settings[name].values()}, set(self.scaling[name].values())
        if len(ranks) == 1 and len(scales) == 1:
            out.update(r=ranks.pop(), scale=scales.pop())
        return out

    def delta_weight(self, name: str, pname: str) -> torch.Tensor:
        """``s B_e A_e`` for every expert, float32, in the parameter's own layout."""
        a, b = self.lora_A[name][pname], self.lora_B[name][pname]
        delta = torch.bmm(b, a) * self.scaling[name][pname]          # (E, out, in)
        return delta.transpose(1, 2) if self.transposed else delta

    def merge(self, name: str) -> None:
        """Add adapter ``name``'s deltas to the expert weights (summed in float32, rounded once;
        an adapter already merged is skipped)."""
        if name in self._merged:
            return
        self._add_to_base(name, 1.0)
        self._merged.append(name)

    def unmerge(self) -> None:
        """Subtract every merged adapter's deltas, newest first."""
        while self._merged:
            self._add_to_base(self._merged.pop(), -1.0)

    def _add_to_base(self, name: str, sign: float) -> None:
        with torch.no_grad():
            for pname in self.lora_A[name]:
                w = self._param(pname)
                w.copy_((w.float() + sign * self.delta_weight(name, pname)).to(w.dtype))

    def delete(self, name: str) -> None:
        """Remove adapter ``name`` (unmerging first if needed)."""
        if name in self._merged:
            self.unmerge()
        del self.lora_A[name], self.lora_B[name]
        self.settings.pop(name, None)
        self.scaling.pop(name, None)
        self._forget(name)

    # ----- compute ------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """The base module's forward with ``W + sum_active s B A`` for each adapted parameter
        (merged adapters are in ``W`` already; without active pairs, the plain forward).

        Each adapter's term is one ``baddbmm`` into the running weight, with the factors cast
        to the weight's dtype (as PEFT does), so the only ``(E, out, in)`` tensor made per
        parameter is the effective weight itself.
        """
        weights: dict[str, torch.Tensor] = {}
        for name in self._active:
            if name in self._merged:
                continue
            for pname in self.lora_A[name]:
                w = weights.get(pname, self._param(pname))
                a = self.lora_A[name][pname].to(w.dtype)                 # (E, r, in)
                b = self.lora_B[name][pname].to(w.dtype)                 # (E, out, r)
                s = self.scaling[name][pname]
                if self.transposed:                                      # W (E, in, out)
                    weights[pname] = torch.baddbmm(w, a.transpose(1, 2), b.transpose(1, 2), alpha=s)
                else:                                                    # W (E, out, in)
                    weights[pname] = torch.baddbmm(w, b, a, alpha=s)
        if not weights:
            return self.base_layer(*args, **kwargs)
        return torch.func.functional_call(self.base_layer, weights, args, kwargs)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}.{p}: r={s['r']}" for n, ps in self.settings.items() for p, s in ps.items())
