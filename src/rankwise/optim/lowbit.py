"""Low-bit optimizer state (``optim.state_bits: 8``): Adam's moments stored as 8-bit codes.

Blockwise dynamic quantisation (Dettmers et al., ICLR 2022, "8-bit Optimizers via Block-wise
Quantization", Sec. 2): a moment tensor is cut into blocks of :data:`BLOCK` elements; each block
keeps its absolute maximum ``a_b`` as one float32 and every element ``x`` as the index of the
nearest entry of a fixed 256-value dynamic (tree) map ``Q`` to ``x / a_b``. Dequantisation is
``Q[code] * a_b``. The first moment uses the signed map, the second (non-negative) the unsigned
one, as bitsandbytes' own 8-bit Adam does. The quantiser is bitsandbytes' ``quantize_blockwise``
/ ``dequantize_blockwise``, which run on CPU and CUDA (measured choice, see docs/optimizers.md).

Each step dequantises a parameter's moments to float32, runs the ordinary update
(:func:`rankwise.optim.adam.adam_direction`) and quantises them back, so only one parameter's
moments are ever held in float32. State per moment of ``k`` elements: ``k`` bytes of codes
(uint8, the moment's shape) plus ``ceil(k / BLOCK)`` float32 block maxima.
"""
from __future__ import annotations

import importlib.util
import math
from functools import lru_cache

import torch

from rankwise.optim.adam import adam_direction

BLOCK = 256       # elements per block (bitsandbytes' blockwise 8-bit optimizers use 256)
BITS = (8,)       # what the backend stores; 4-bit moments are refused (see :func:`bits_problems`)
MOMENTS = ("exp_avg", "exp_avg_sq")


def bits_problems(bits: int | None) -> list[str]:
    """Config problems of ``state_bits`` (empty when valid).

    bitsandbytes' 4-bit formats (NF4/FP4) are weight formats without an optimizer-state path, so
    only 8 is accepted; ``None`` means float32 state.
    """
    if bits is None:
        return []
    if bits not in BITS:
        return [f"state_bits: got {bits!r}; the bitsandbytes backend stores optimizer state in "
                "8 bits only (its 4-bit formats are for weights); use 8 or null"]
    if importlib.util.find_spec("bitsandbytes") is None:   # found, not imported (its import is slow)
        return ["state_bits: 8 needs bitsandbytes; pip install bitsandbytes (or set state_bits: null)"]
    return []


def moment_floats(numel: int, bits: int | None) -> float:
    """State of one moment of ``numel`` elements in 4-byte units: ``numel`` in float32, or
    ``numel / 4 + ceil(numel / BLOCK)`` (1-byte codes + one float32 maximum per block)."""
    return numel if bits is None else numel / 4 + math.ceil(numel / BLOCK)


@lru_cache(maxsize=None)
def _code(signed: bool, device: str) -> torch.Tensor:
    """bitsandbytes' 256-entry dynamic map on ``device`` (cached)."""
    import bitsandbytes.functional as F
    return F.create_dynamic_map(signed=signed).to(device)


def _signed(key: str) -> bool:
    return key != "exp_avg_sq"


def load(state: dict, key: str, like: torch.Tensor) -> torch.Tensor:
    """The float32 moment ``key`` of ``state`` (zeros shaped like ``like`` when absent).

    Args:
        state: The parameter's optimizer state, holding ``key`` (uint8 codes) and
            ``key + "_absmax"`` once stored.
        key: ``exp_avg`` or ``exp_avg_sq`` (or any signed moment).
        like: Gives shape, dtype and device of a fresh moment.

    Returns:
        A new float32 tensor (changing it does not change the state).
    """
    if key not in state:
        return torch.zeros_like(like, dtype=torch.float32)
    import bitsandbytes.functional as F
    codes = state[key]
    return F.dequantize_blockwise(codes, absmax=state[key + "_absmax"],
                                  code=_code(_signed(key), str(codes.device)), blocksize=BLOCK)


def store(state: dict, key: str, value: torch.Tensor) -> None:
    """Quantise ``value`` into ``state[key]`` (uint8 codes) and ``state[key + "_absmax"]``."""
    import bitsandbytes.functional as F
    codes, qs = F.quantize_blockwise(value.float().contiguous(), code=_code(_signed(key), str(value.device)),
                                     blocksize=BLOCK)
    state[key], state[key + "_absmax"] = codes, qs.absmax


def restore_codes(states) -> None:
    """Cast every quantised moment (a key with a ``_absmax`` companion) in ``states`` back to
    uint8, after ``torch.optim.Optimizer.load_state_dict`` cast it to the parameter's dtype.

    Args:
        states: The per-parameter state dicts (``optimizer.state.values()``).
    """
    for st in states:
        for key in [k for k in st if k + "_absmax" in st]:
            st[key] = st[key].to(torch.uint8)


def quantized_adam_direction(state: dict, grad: torch.Tensor, beta1: float, beta2: float, eps: float,
                             step: int, bits: int | None) -> torch.Tensor:
    """:func:`rankwise.optim.adam.adam_direction` with the moments kept in ``bits`` bits.

    Args:
        state: The parameter's optimizer state.
        grad: The (possibly projected) gradient the moments track.
        beta1, beta2, eps, step: As :func:`adam_direction`.
        bits: ``None`` (float32 moments, exactly :func:`adam_direction`) or 8.

    Returns:
        The bias-corrected Adam direction, float32, shaped like ``grad``.
    """
    if bits is None:
        return adam_direction(state, grad, beta1, beta2, eps, step)
    moments = {k: load(state, k, grad) for k in MOMENTS}
    direction = adam_direction(moments, grad.float(), beta1, beta2, eps, step)
    for k in MOMENTS:
        store(state, k, moments[k])
    return direction
