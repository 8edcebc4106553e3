"""GoRA: gradient-driven rank allocation and initialisation of plain LoRA layers.

The result of :func:`apply_gora` is an ordinary :class:`~rankwise.adapters.lora.LoraLayer`
per adapted path, with per-layer ranks; saving, loading, merging and the PEFT export
(``rank_pattern``) therefore work exactly as for LoRA.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from rankwise.adapters.gora.allocate import allocate_ranks, importance, normalise
from rankwise.adapters.gora.config import GoraConfig
from rankwise.adapters.gora.gradients import accumulate_gradients, model_loss
from rankwise.adapters.lora import LoraConfig, LoraLayer, apply_lora
from rankwise.core import weights as layer_weights
from rankwise.core.inject import find_targets
from rankwise.core.quant import keep_training_layout
from rankwise.errors import RankwiseError

REPORT_ATTR = "_rankwise_gora"


class GoraResult(dict):
    """``{path: LoraLayer}`` returned by :func:`apply_gora`, plus the allocation report.

    The train recipe calls :meth:`write_artifacts` on a method's result when it has one.

    Attributes:
        report: The dict also returned by :func:`gora_report`.
    """

    def __init__(self, layers: dict[str, LoraLayer], report: dict[str, Any]) -> None:
        super().__init__(layers)
        self.report = report

    def write_artifacts(self, run_dir: str | Path) -> None:
        """Write ``ranks.json`` (ranks, importances, budget, memory) and ``ranks.png``.

        Args:
            run_dir: The run folder.
        """
        from rankwise.adapters.gora.report import plot_ranks, write_ranks
        write_ranks(self.report, Path(run_dir) / "ranks.json")
        plot_ranks(self.report, Path(run_dir) / "ranks.png")


def projected_step_b(grad: torch.Tensor, a: torch.Tensor, scale: float, eta: float,
                     sign: float = -1.0) -> torch.Tensor:
    """Return B such that ``scale * B @ A == sign * eta * G @ P_A`` (GoRA, step 3).

    ``P_A = Aᵀ (A Aᵀ)⁻¹ A`` projects onto A's row space, so ``s·B A`` is one gradient step of
    size eta restricted to the directions A can express: B = sign·(eta/s)·G Aᵀ (A Aᵀ)⁻¹.
    The paper writes the pseudo-inverse of A; for a random A of full row rank (r <= n_in)
    that is ``Aᵀ (A Aᵀ)⁻¹``, which is what we solve (in float64, then cast).

    Args:
        grad: G, shape (out, in).
        a: A, shape (r, in), full row rank.
        scale: The layer's LoRA scale s.
        eta: Step size.
        sign: -1 for a descent step, +1 for ascent.

    Returns:
        B, shape (out, r), in ``a``'s dtype.
    """
    a64, g64 = a.detach().double(), grad.detach().double()
    gram = a64 @ a64.T                       # (r, r)
    ga = g64 @ a64.T                         # (out, r)
    b = torch.linalg.solve(gram, ga.T).T     # G Aᵀ (A Aᵀ)⁻¹ since gram is symmetric
    return (b * (sign * eta / scale)).to(a.dtype)


def _lora_config(config: GoraConfig, paths: list[str]) -> LoraConfig:
    return LoraConfig(r=config.r, alpha=config.alpha, targets=list(paths), dropout=config.dropout,
                      use_rslora=config.use_rslora, modules_to_save=config.modules_to_save)


def _calibrate(model: nn.Module, config: GoraConfig, modules: dict[str, nn.Module],
               batches: Iterable[dict], loss_fn: Callable[[nn.Module, dict], torch.Tensor]):
    """Steps 1-2: average each target's gradient; return the stats and the importances."""
    def score(grads: dict[str, torch.Tensor]) -> dict[str, float]:  # grads in storage layout
        return {p: importance(config.importance, layer_weights.dense_weight(modules[p]),
                              layer_weights.to_storage_layout(modules[p], g), config.r) for p, g in grads.items()}

    keep_training_layout(model)  # 4-bit layers must keep their training layout (core/quant.py)
    # a packed (quantized) weight cannot hold a gradient: its layer's G comes from activations
    targets = {p: m if layer_weights.is_quantized(m) else layer_weights.storage_param(m) for p, m in modules.items()}
    stats = accumulate_gradients(model, targets,
                                 batches, config.n_batches,
                                 score=score if config.early_stop else None,
                                 stop_tolerance=config.stop_tolerance,
                                 min_batches=config.min_batches, loss_fn=loss_fn)
    scores = stats.history[-1] if stats.history else score(stats.grads)
    return stats, scores


def _allocate(config: GoraConfig, scores: dict[str, float],
              dims: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Step 2: per-layer ranks under the budget (warns when r_min/r_max leave no freedom)."""
    shares = normalise(scores, config.sqrt_importance, config.softmax_temperature)
    r_min, r_max = config.min_rank, config.max_rank
    ranks = allocate_ranks(shares, dims, config.r, r_min, r_max, config.allocation)
    if r_min >= config.r or r_max <= config.r:
        # stacklevel 3: the warning points at apply_gora's caller
        warnings.warn(f"GoRA: r_min={r_min}, r_max={r_max} around r={config.r} leave the allocation "
                      "(almost) no freedom; ranks stay near uniform. Leave r_min/r_max unset "
                      "(r/2 and 4r) to let importance decide", stacklevel=3)
    return ranks


def _init_b(config: GoraConfig, layers: dict[str, LoraLayer], grads: dict[str, torch.Tensor],
            adapter_name: str) -> dict[str, float]:
    """Step 3: set each B to the projected gradient step; return the step size per layer."""
    sign = -1.0 if config.init_sign == "descent" else 1.0
    etas: dict[str, float] = {}
    with torch.no_grad():
        for p, layer in layers.items():
            a = layer.lora_A[adapter_name].weight                   # (r, in)
            r, n_in = a.shape
            eta = config.init_lr * (math.sqrt(n_in / r) if config.scale_init_by_dim else 1.0)
            g = grads[p]                                             # (out, in)
            b = layer.lora_B[adapter_name].weight
            b.copy_(projected_step_b(g, a, layer.scaling[adapter_name], eta, sign).to(b.device))
            etas[p] = eta
    return etas


def _report(config: GoraConfig, adapter_name: str, paths: list[str], dims: dict[str, tuple[int, int]],
            ranks: dict[str, int], scores: dict[str, float], etas: dict[str, float],
            stats) -> dict[str, Any]:
    """The JSON-ready allocation report that :func:`gora_report` returns."""
    budget = sum((m + n) * config.r for m, n in dims.values())
    return {
        "method": "gora", "adapter": adapter_name, "r0": config.r,
        "r_min": config.min_rank, "r_max": config.max_rank,
        "importance": config.importance, "allocation": config.allocation,
        "budget_params": budget,
        "allocated_params": sum((dims[p][0] + dims[p][1]) * ranks[p] for p in paths),
        "ranks": {p: int(ranks[p]) for p in paths},
        "importances": {p: float(scores[p]) for p in paths},
        "shapes": {p: list(dims[p]) for p in paths},
        "init": {"sign": config.init_sign, "eta": etas},
        "batches": stats.batches, "early_stopped": stats.early_stopped,
        "importance_history": stats.history,
        "memory": stats.memory(),
    }


def apply_gora(model: nn.Module, config: GoraConfig, adapter_name: str = "default",
               batches: Iterable[dict] | None = None,
               loss_fn: Callable[[nn.Module, dict], torch.Tensor] = model_loss) -> GoraResult:
    """Inject GoRA adapter ``adapter_name``: allocate ranks from gradients, then init B.

    Implements GoRA (arXiv 2502.12171, NeurIPS 2025) steps 1-3: average each target weight's
    gradient G over ``config.n_batches`` batches (from activations and output gradients for a
    quantized base layer, see :mod:`rankwise.adapters.gora.gradients`), score every layer (``config.importance``,
    the paper's mean|W ⊙ G| by default), allocate ranks under the budget
    ``sum_W (m_W + n_W) * r0`` clamped to [r_min, r_max] (rank 0 skips a layer), inject plain
    LoRA layers with those ranks (A Kaiming-uniform as in the code), and set
    ``B = ∓(eta/s)·G Aᵀ (A Aᵀ)⁻¹`` so that the initial update is ``s·B A = ∓eta·G·P_A``
    (``config.init_sign``; eta = init_lr·sqrt(n_in / r_W) with ``scale_init_by_dim``).
    The base weights are not modified (the code's ``reinit_weight=False``); the model's
    output therefore moves by that one projected step at initialisation.

    The allocation and importances are kept on the model; read them with
    :func:`rankwise.adapters.gora.gora_report`.

    Args:
        model: The model; ``model(**batch).loss`` must be the training loss.
        config: GoRA settings.
        adapter_name: Name of the adapter.
        batches: Calibration batches (the train recipe passes its training iterator).
        loss_fn: ``loss_fn(model, batch)`` -> training loss (default ``model(**batch).loss``).

    Returns:
        A :class:`GoraResult`: ``{path: LoraLayer}`` for the layers that received a rank > 0,
        with ``.report`` and ``.write_artifacts(run_dir)`` (``ranks.json``, ``ranks.png``).

    Raises:
        RankwiseError: Without batches, on targets matching nothing, or on batches without
            a loss.
    """
    if batches is None:
        raise RankwiseError("method 'gora' needs calibration batches: in Python pass "
                            "rankwise.apply(model, 'gora', batches=<iterable of batch dicts>); "
                            "rankwise train uses train.calibration_batches of its training data")
    paths = find_targets(model, config.targets, config.exclude, "method.targets")
    modules = {p: model.get_submodule(p) for p in paths}
    dims = {p: layer_weights.shape(m) for p, m in modules.items()}  # (out, in)
    stats, scores = _calibrate(model, config, modules, batches, loss_fn)
    # accumulated in storage layout; B's init reads (out, in)
    grads = {p: layer_weights.to_storage_layout(modules[p], g) for p, g in stats.grads.items()}
    ranks = _allocate(config, scores, dims)

    structure = {p: {"r": ranks[p], "alpha": config.alpha, "use_rslora": config.use_rslora}
                 for p in paths}
    layers = apply_lora(model, _lora_config(config, paths), adapter_name, structure=structure)
    etas = _init_b(config, layers, grads, adapter_name)
    del stats.grads, grads

    report = _report(config, adapter_name, paths, dims, ranks, scores, etas, stats)
    reports = dict(getattr(model, REPORT_ATTR, {}))
    reports[adapter_name] = report
    object.__setattr__(model, REPORT_ATTR, reports)
    return GoraResult(layers, report)


def rebuild_gora(model: nn.Module, config: GoraConfig, adapter_name: str,
                 layers: dict[str, dict]) -> dict[str, LoraLayer]:
    """Recreate a saved GoRA adapter from its per-layer ranks, without calibration.

    Args:
        model: The base model.
        config: The GoRA config it was trained with.
        adapter_name: Name of the adapter.
        layers: ``{path: {"r", "alpha", "use_rslora"}}`` as saved (layers of rank 0 are absent).

    Returns:
        ``{path: LoraLayer}``.

    Raises:
        RankwiseError: With no saved structure (GoRA's ranks come from data, not the config).
    """
    if not layers:
        raise RankwiseError("a GoRA adapter can only be rebuilt from its saved per-layer ranks; "
                            "the file holds none: re-save it from its run folder")
    return apply_lora(model, _lora_config(config, list(layers)), adapter_name, structure=layers)


def gora_report(model: nn.Module, adapter_name: str = "default") -> dict | None:
    """Return what :func:`apply_gora` decided for ``adapter_name``, or None for other methods.

    Args:
        model: A model adapted by :func:`apply_gora` (or not).
        adapter_name: The adapter.

    Returns:
        A JSON-ready dict with ``ranks`` and ``importances`` (``{path: value}``, rank 0 for
        skipped layers), ``shapes`` ((out, in) per path), ``budget_params`` /
        ``allocated_params``, ``batches`` used, ``early_stopped``, ``init`` (sign and eta per
        layer) and ``memory`` (bytes of the gradient phase); None if GoRA was not applied.
    """
    return getattr(model, REPORT_ATTR, {}).get(adapter_name)
