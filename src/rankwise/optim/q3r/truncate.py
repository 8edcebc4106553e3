"""After Q3R training: replace regularized linear layers by their rank-r factors."""
from __future__ import annotations

import torch
from torch import nn

from rankwise.core import weights as layer_weights
from rankwise.core.inject import find_targets, replace_module
from rankwise.errors import RankwiseError
from rankwise.optim.common import DEFAULT_TARGETS
from rankwise.optim.q3r.optimizer import _svd_dtype, target_rank


class LowRankLinear(nn.Module):
    """``y = up(down(x))``: a linear layer stored as two factors of rank ``r``.

    Args:
        in_features: Input width ``n``.
        out_features: Output width ``m``.
        rank: Inner width ``r``.
        bias: Whether ``up`` has a bias.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down = nn.Linear(in_features, rank, bias=False)   # (r, n)
        self.up = nn.Linear(rank, out_features, bias=bias)     # (m, r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply ``up(down(x))``; ``x`` is ``(..., n)``, the result ``(..., m)``."""
        return self.up(self.down(x))


def _factor(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-``r`` factors ``(up, down)`` of an ``m x n`` weight, singular values split
    evenly (``up = U_r S^{1/2}``, ``down = S^{1/2} V_r^T``)."""
    u, s, vh = torch.linalg.svd(_svd_dtype(weight), full_matrices=False)
    root = s[:rank].sqrt()
    return (u[:, :rank] * root).to(weight.dtype), (root[:, None] * vh[:rank]).to(weight.dtype)


@torch.no_grad()
def truncate_to_factorized(model: nn.Module, rank: float,
                           targets: list[str] | str = DEFAULT_TARGETS,
                           scale_rank: bool = True) -> dict[str, int]:
    """Replace each selected linear layer by a :class:`LowRankLinear` of the rank Q3R
    regularized it to (:func:`rankwise.optim.q3r.target_rank` of ``rank`` and its shape).

    This is Q3R's final step (train to a prescribed rank, then truncate). Typical use::

        opt = rankwise.registry.get("optimizer", "q3r").builder(model, cfg)
        ...train...
        report = truncate_to_factorized(model, rank=cfg.rank, targets=cfg.targets,
                                        scale_rank=cfg.scale_rank)

    Pass the same ``rank``, ``targets`` and ``scale_rank`` as the optimizer config so exactly
    the regularized layers are factorized, each at its regularized rank (the authors'
    truncation script takes a separate parameter-count fraction instead). Layers whose factors would not be smaller than the dense weight
    (``r (m + n) >= m n``) are left dense.

    Args:
        model: The trained model (changed in place).
        rank: As the optimizer's ``rank`` (the top singular directions of each weight kept).
        targets: As the optimizer's ``targets`` (:func:`rankwise.optim.common.split_params`).
        scale_rank: As the optimizer's ``scale_rank``.

    Returns:
        ``{"layers": k, "params_before": a, "params_after": b}`` over the replaced layers.

    Raises:
        RankwiseError: If ``rank`` is not positive.
    """
    if not rank > 0:
        raise RankwiseError(f"truncate_to_factorized: got rank={rank!r}; expected a positive integer "
                            "or a fraction in (0, 1)")
    report = {"layers": 0, "params_before": 0, "params_after": 0}
    for path in find_targets(model, targets or DEFAULT_TARGETS, what="optim.targets"):
        module = model.get_submodule(path)
        dense = layer_weights.dense_weight(module)  # (m, n) = (out, in)
        m, n = dense.shape
        r = target_rank(rank, (m, n), scale_rank)
        if r * (m + n) >= m * n:
            continue
        bias = getattr(layer_weights.base_layer(module), "bias", None)
        new = LowRankLinear(n, m, r, bias=bias is not None).to(dtype=dense.dtype, device=dense.device)
        up, down = _factor(dense, r)
        new.up.weight.copy_(up)
        new.down.weight.copy_(down)
        if bias is not None:
            new.up.bias.copy_(bias)
        replace_module(model, path, new)
        report["layers"] += 1
        report["params_before"] += m * n
        report["params_after"] += r * (m + n)
    return report
