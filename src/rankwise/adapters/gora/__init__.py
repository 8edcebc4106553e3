"""GoRA (arXiv 2502.12171, NeurIPS 2025; docs/adaptive-rank.md): gradient-driven adaptive rank
and initialisation; one registration.

The builder returns a :class:`GoraResult`; ``rankwise train`` calls its
``write_artifacts(run_dir)``, which writes ``ranks.json`` and ``ranks.png``. Elsewhere::

    from rankwise.adapters.gora import gora_report, plot_ranks, write_ranks
    report = gora_report(model, adapter_name)      # None unless the method was gora
    if report is not None:
        write_ranks(report, run_dir / "ranks.json")
        plot_ranks(report, run_dir / "ranks.png")
"""
from __future__ import annotations

from rankwise import registry
from rankwise.adapters.gora.allocate import allocate_ranks, importance, normalise
from rankwise.adapters.gora.config import GoraConfig
from rankwise.adapters.gora.gradients import accumulate_gradients
from rankwise.adapters.gora.layer import (GoraResult, apply_gora, gora_report, projected_step_b,
                                          rebuild_gora)
from rankwise.adapters.gora.report import plot_ranks, write_ranks

__all__ = ["GoraConfig", "GoraResult", "apply_gora", "gora_report", "plot_ranks", "write_ranks",
           "allocate_ranks", "importance", "normalise", "accumulate_gradients", "projected_step_b",
           "rebuild_gora"]

registry.register("method", "gora", GoraConfig, apply_gora, needs_batches=True,
                  rebuild=rebuild_gora, factorized=True,
                  layer_score=lambda w, g: importance(GoraConfig.importance, w, g, GoraConfig.r),
                  summary="GoRA: gradient-driven adaptive ranks + projected-gradient init (NeurIPS 2025)")
