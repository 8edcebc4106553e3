"""The config fields that layer-wrapping methods share, with their checks written once.

A method's config dataclass subclasses :class:`TargetedConfig` (where the adapters go) or
:class:`LoraPairConfig` (a LoRA-shaped pair on top: ``r``, ``alpha``, ``dropout``,
``use_rslora``), re-declares ``name`` and any default of its own with its range
(``r: int = bounded(2, ge=1)``: a plain re-declaration would drop the range), and extends
``problems()`` with ``super().problems()``. Defaults stay in the dataclasses, as everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Union

from rankwise.configs import bounded


@dataclass
class TargetedConfig:
    """Which layers a method adapts, and what trains beside it.

    Attributes:
        name: Registry name (each method re-declares it).
        targets: ``"all-linear"``, ``"block-linear"``, a regex over module paths, or a list of
            name suffixes (see :mod:`rankwise.core.inject`).
        exclude: Name suffixes never adapted.
        modules_to_save: Whole modules trained and saved with the adapter; ``None`` means the
            task head for classification models (``classifier`` / ``score``), else none.
        trainable_tokens: Tokens whose embedding rows (and output-head rows) train, as a small
            delta beside the frozen table (PEFT's ``trainable_token_indices``;
            :mod:`rankwise.core.tokens`): a list of token strings, ``true`` for the tokens of
            ``model.add_tokens`` / ``model.add_special_tokens``, or ``null`` for none.
    """

    name: str = ""
    targets: Union[list[str], str] = "all-linear"
    exclude: list[str] = field(default_factory=list)
    modules_to_save: Union[list[str], None] = None
    trainable_tokens: Union[bool, list[str], None] = None

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        if isinstance(self.trainable_tokens, list) and not all(self.trainable_tokens):
            return ["trainable_tokens: got an empty token string; list token strings such as "
                    "'<|im_end|>', or true for the added tokens"]
        return []


@dataclass
class LoraPairConfig(TargetedConfig):
    """A LoRA-shaped pair per target layer, ``s B A x`` with ``s = alpha / r`` (Hu et al. 2021,
    eq. 3) or ``alpha / sqrt(r)`` (rsLoRA, Kalajdzievski 2023).

    Attributes:
        r: Rank.
        alpha: Scale numerator.
        dropout: Dropout on the adapter input.
        use_rslora: s = alpha / sqrt(r).
        target_parameters: Fused 3-D expert parameters to adapt with a pair per expert, by
            name or suffix (``mlp.experts.gate_up_proj``; see
            :mod:`rankwise.adapters.common.experts`), beside the ``targets`` layers (``[]``:
            none of those). Only methods that set ``parameter_targets`` accept it.
    """

    # Whether the method builds expert layers at ``target_parameters`` (LoRA does).
    parameter_targets: ClassVar[bool] = False

    r: int = bounded(8, ge=1)
    alpha: float = bounded(16.0, gt=0)
    dropout: float = bounded(0.0, ge=0.0, lt=1.0)
    use_rslora: bool = False
    target_parameters: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        out = super().problems()
        if self.target_parameters and not self.parameter_targets:
            out.append(f"target_parameters: method {self.name!r} adapts linear layers only; "
                       "use method.name: lora for fused expert parameters")
        if self.target_parameters and self.dropout:
            out.append(f"dropout: got {self.dropout} with target_parameters; expected 0 (an "
                       "expert delta is added to the weight, so it has no input to drop)")
        return out
