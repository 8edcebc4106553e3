"""Shared pieces of the compression tests: a layer problem with correlated inputs, configs."""
from __future__ import annotations

import torch

from rankwise import registry
from rankwise.configs import from_dict


def problem(out_f: int = 32, in_f: int = 64, n: int = 1024, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W, H)``: a random weight and the Gram matrix ``XᵀX / n`` of strongly correlated inputs
    with uneven channel scales (the regime where Hessian-aware methods should win)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(in_f, in_f, generator=g) / in_f ** 0.5 + torch.eye(in_f)
    x = (torch.randn(n, in_f, generator=g) @ mix) * (torch.rand(in_f, generator=g) * 2 + 0.1)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    return w, x.T @ x / n


def compressor(name: str, **keys):
    """The registered compressor ``name`` built from ``keys`` (validated like YAML)."""
    entry = registry.get("compressor", name)
    return entry.builder(from_dict(entry.config_cls, {"method": name, **keys}, "compress"))
