"""``rankwise bench shapley``: fine-tuning only the top 10 % of neurons on the demo task, chosen by
Model Shapley (``method: {name: full, select: shapley, fraction: 0.1}``) vs by |g|, |g·θ| and at
random at the same fraction, and full fine-tuning (docs/inspect.md).

Every row runs through ``rankwise train``'s pipeline on the demo task (common.DEMO_BASE: the
packaged MiniLM, batches of 32, sequences of 32 tokens; ``--steps`` shortens it) with AdamW at one
learning rate, 2e-4, for all rows (no per-row tuning); the neuron scores use
``train.calibration_batches: 2`` (64 examples; Model Shapley takes one backward per example for
its Fisher blocks). The task head always trains.

``--setting related`` runs the paper's setting instead, a model already fine-tuned on related
data (the reference base on stdlib-functions: :mod:`rankwise_bench.shapley_related`).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from rankwise_bench.common import (DEMO_BASE, Settings, chosen_rows, markdown_table, pct, run_row, seeded_rows,
                                   summarise, with_settings, write_results)

LR = 2e-4
CALIBRATION = {**DEMO_BASE["train"], "calibration_batches": 2}
ROWS: dict[str, dict] = {
    **{f"top10-{sel}": {**DEMO_BASE, "train": CALIBRATION,
                        "method": {"name": "full", "select": sel, "fraction": 0.1},
                        "optim": {"name": "adamw", "lr": LR}}
       for sel in ("shapley", "grad", "grad_weight", "random")},
    "full": {**DEMO_BASE, "method": {"name": "full"}, "optim": {"name": "adamw", "lr": LR}},
}


def run(out: Path, settings: Settings | None = None) -> dict:
    """Run every row for each seed; write ``results.json`` and ``results.md``.

    Args:
        out: Output folder.
        settings: Size of the comparison (default: 3 seeds, the demo's budget).

    Returns:
        The results written to ``results.json``.

    Raises:
        RankwiseError: On an unknown row.
    """
    s = settings or Settings()
    rows = chosen_rows("shapley", s.rows, ROWS)
    out, began = Path(out), time.time()

    def one(row: str, seed: int) -> dict:
        t0 = time.time()
        metrics, _ = run_row(with_settings(ROWS[row], s, seed), out / "runs" / row / f"seed{seed}")
        return {"seed": seed, "accuracy": metrics["eval_accuracy"], "eval_loss": metrics["eval_loss"],
                "wall_s": time.time() - t0}
    records = seeded_rows(rows, s.seeds, one, rows_first=False)
    summary = summarise(records, ("accuracy", "eval_loss", "wall_s"))
    result = {"settings": s.__dict__, "rows": {r: ROWS[r] for r in rows}, "runs": records,
              "summary": summary, "wall_s": time.time() - began, "torch": torch.__version__}
    write_results(out, result, markdown(result))
    return result


def markdown(result: dict) -> str:
    """``results.md`` from the record: the mean ± std table over seeds (a ``--setting related``
    record renders through :func:`rankwise_bench.shapley_related_report.markdown`)."""
    if "stage1" in result:
        from rankwise_bench import shapley_related_report
        return shapley_related_report.markdown(result)
    md = ["# shapley: top-10 % neurons on the demo task\n",
          f"{result['settings']['seeds']} seed(s); mean ± sample std; AdamW lr {LR} for every row; wall seconds "
          "taken while other processes shared the CPU.\n",
          markdown_table(result["summary"], [("accuracy", "demo accuracy (%)", pct),
                                             ("eval_loss", "eval loss", lambda x: f"{x:.3f}"),
                                             ("wall_s", "wall s (selection + training)", lambda x: f"{x:.0f}")]),
          ""]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench shapley --out DIR [--rows a,b] [--seeds N] [--steps N] ...`` (the demo task), or
    ``rankwise bench shapley --setting related --out DIR [--preset P] [--set FIELD=VALUE ...]`` (a model
    fine-tuned on related data first: :mod:`rankwise_bench.shapley_related`)."""
    import argparse
    import sys
    from rankwise_bench.common import demo_main
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --set is not --setting
    ap.add_argument("--setting", choices=("demo", "related"), default="demo")
    known, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.setting == "related":
        from rankwise_bench import shapley_related
        return shapley_related.main(rest)
    return demo_main(run, tuple(ROWS), rest)


if __name__ == "__main__":
    import sys
    sys.exit(main())
