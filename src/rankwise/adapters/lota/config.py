"""Configuration of ``lota-qaf``: the one place its defaults live."""
from __future__ import annotations

from dataclasses import dataclass

from rankwise.adapters.common.config import TargetedConfig
from rankwise.configs import bounded

SUPPORTED_BITS = (2, 4, 8)  # codes are packed 8 / bits per byte


@dataclass
class LotaConfig(TargetedConfig):
    """LoTA-QAF: lossless ternary adaptation of a quantized base (arXiv 2505.18724).

    Defaults follow the authors' scripts (``r`` 64 for 8B/14B models, ``interval_point`` 48,
    i.e. ``omega = 0.75 r``) on a 4-bit base with GPTQ's usual group size 128.

    Attributes:
        name: Registry name (``lota-qaf``).
        r: Rank of the ternary factors ``A (r, in)``, ``B (out, r)``.
        bits: Bits of the integer grid the base is quantized to: 2, 4 or 8.
        group_size: Input columns sharing one scale and zero point; capped at each layer's input
            size, and it must divide it.
        threshold_ratio: ``omega = threshold_ratio * r``: an entry of ``Delta = B A`` (an integer
            in ``[-r, r]``) moves its code by one grid step only beyond ``+-omega``.
        fold_offsets: On merge, fold the offset factors into the float zero points (the merged
            model's output equals the adapted one's); ``false`` keeps the integer zero points
            and drops them (the documented difference ``s * zp`` per group).
        targets: ``"all-linear"``, ``"block-linear"``, a regex over module paths, or names.
        exclude: Name suffixes never adapted.
        modules_to_save: Whole modules trained and saved with the adapter; ``None`` means the
            task head for classification models.
    """

    name: str = "lota-qaf"
    r: int = bounded(64, ge=1)
    bits: int = 4
    group_size: int = bounded(128, ge=1, hint="such as 128")
    threshold_ratio: float = bounded(0.75, gt=0, lt=1, hint="such as 0.75")
    fold_offsets: bool = True

    def problems(self) -> list[str]:
        """Return value errors as ``"field: message"`` strings (empty when valid)."""
        out = super().problems()
        if self.bits not in SUPPORTED_BITS:
            out.append(f"bits: got {self.bits}; expected one of {list(SUPPORTED_BITS)} (the integer "
                       "grid packs 8/bits codes per byte)")
        return out
