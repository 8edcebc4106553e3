"""Stand-ins :mod:`rankwise.recipes.plan` uses where a meta forward cannot run as the real one.

A meta tensor has shapes but no values, so two things a real forward does need help:

* **grouped matmul** (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``, the MoE
  experts' kernel transformers picks, ``grouped_mm`` experts): its meta kernel accepts only bf16
  inputs (the CUDA kernel's rule) while the CPU kernel also runs float32, so a float32 MoE model
  fails on meta. :func:`grouped_mm` computes the output's shape through the bf16 meta kernel
  and saves, for backward, exactly what the kernel's autograd node saves;
* **reading a mask**: transformers asks whether an attention mask is all ones
  (``masking_utils.fast_all``) before choosing the causal kernel. The planner's counted batch is
  full rows (padding is emulated at the attention, :class:`rankwise.recipes.plan._Probe`), so
  any mask made from it - prompt methods prepend their virtual tokens' ones - is all ones.
"""
from __future__ import annotations

import torch

GROUPED = {f for f in (getattr(torch.nn.functional, "grouped_mm", None),
                       getattr(torch, "_grouped_mm", None)) if f is not None}


class _GroupedMM(torch.autograd.Function):
    """``grouped_mm(a, b, offs)`` on meta tensors of any dtype. Saves what the kernel's node
    saves: ``b`` when ``a`` needs a gradient, ``a`` when ``b`` does, and ``offs``."""

    @staticmethod
    def forward(ctx, func, a, b, offs, out_dtype):
        need_a, need_b = ctx.needs_input_grad[1:3]
        ctx.save_for_backward(*[t for t, keep in ((a, need_b), (b, need_a), (offs, need_a or need_b))
                                if keep and t is not None])
        return func(a.bfloat16(), b.bfloat16(), offs=offs).to(out_dtype or a.dtype)

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover - a meta forward is never differentiated
        raise NotImplementedError("plan's meta grouped_mm has no backward")


def grouped_mm_needs_stand_in(func, args, kwargs) -> bool:
    """True for a grouped matmul on meta tensors that its meta kernel would refuse."""
    return (func in GROUPED and bool(args) and args[0].device.type == "meta"
            and args[0].dtype != torch.bfloat16 and kwargs.get("bias") is None)


def grouped_mm(func, args, kwargs) -> torch.Tensor:
    """Run ``func(mat_a, mat_b, offs=...)`` through :class:`_GroupedMM`.

    Args:
        func: ``torch.nn.functional.grouped_mm`` or ``torch._grouped_mm``.
        args, kwargs: Its call's arguments (``offs`` and ``out_dtype`` by keyword).

    Returns:
        The ``(S, N)`` output (``mat_a`` (S, K), ``mat_b`` (E, K, N)) in ``out_dtype`` or
        ``mat_a``'s dtype, on the autograd graph of both inputs.
    """
    return _GroupedMM.apply(func, args[0], args[1], kwargs.get("offs"), kwargs.get("out_dtype"))


def all_ones(fast_all):
    """``masking_utils.fast_all`` answering ``True`` for a meta mask (the planner's full rows).

    Args:
        fast_all: transformers' own function, used for any tensor that holds values.

    Returns:
        The replacement.
    """
    def patched(mask: torch.Tensor):
        return True if mask.device.type == "meta" else fast_all(mask)
    return patched
