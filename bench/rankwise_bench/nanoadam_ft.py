"""``rankwise bench nanoadam-ft``: NanoAdam vs AdamW full fine-tuning vs LoRA on the demo task -
accuracy, optimizer state bytes, and forgetting, over 3 seeds.

Forgetting. A second held-out task is built from seven *other* standard-library packages
(:data:`TASK_B_PACKAGES`, the same docstring-topic construction as the demo): a linear probe
(the ``frozen`` method: encoder frozen, a 7-class head trained, the demo's frozen settings) is
fitted on it once, on the base model (seed 0). After each fine-tuning run on the demo task, the
fine-tuned encoder is read through that probe (its head put in place of the demo's) on task B's
evaluation split. Forgetting = probe accuracy on the base encoder - probe accuracy on the
fine-tuned one: how far fine-tuning moved the features task B relies on.

Rows: ``nanoadam`` (every weight matrix masked to its 10% smallest entries, the head and vectors
dense; lr 2e-4, 4x the AdamW row's - the paper reports that NanoAdam takes larger rates),
``adamw-full`` (lr 5e-5, examples/compare-full.yaml's), ``lora`` (r 8, AdamW 2e-3, the demo's).
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from rankwise.data.demo import load_demo_records
from rankwise_bench.common import (DEMO_BASE, Settings, accuracy, chosen_rows, markdown_table, memory_record, mib,
                                   pct, run_row, seeded_rows, summarise, with_settings, write_results)

TASK_B_PACKAGES = ("collections", "concurrent", "ctypes", "unittest", "urllib", "wsgiref", "xmlrpc")

ROWS: dict[str, dict] = {
    "nanoadam": {**DEMO_BASE, "method": {"name": "full"},
                 "optim": {"name": "nanoadam", "lr": 2e-4, "density": 0.1}},
    "adamw-full": {**DEMO_BASE, "method": {"name": "full"}, "optim": {"name": "adamw", "lr": 5e-5}},
    "lora": {**DEMO_BASE, "method": {"name": "lora", "r": 8, "alpha": 16}, "optim": {"name": "adamw", "lr": 2e-3}},
}

# The demo's linear-probe settings (commands/demo/demo.yaml's frozen run).
PROBE = {**DEMO_BASE, "method": {"name": "frozen"}, "optim": {"name": "adamw", "lr": 2e-2},
         "train": {**DEMO_BASE["train"], "steps": 90}}


def write_task_b(path: Path) -> Path:
    """Write task B's records (``{"text", "label"}`` per line) to ``path``."""
    records, _ = load_demo_records(TASK_B_PACKAGES)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps({"text": r["text"], "label": r["package"], "id": r["id"]}) + "\n")
    return path


def _probe(out: Path, s: Settings):
    """Fit the task-B probe on the base model; returns ``(accuracy, head state, session)``."""
    data = write_task_b(out / "task-b.jsonl")
    raw = with_settings(PROBE, s, 0)
    raw["data"] = {**raw["data"], "source": str(data), "text_field": "text", "label_field": "label"}
    if s.steps is not None:
        raw["train"]["steps"] = max(s.steps, 2)
    metrics, session = run_row(raw, out / "probe-b")
    head = copy.deepcopy(session.model.classifier)
    return metrics["eval_accuracy"], head, session


def _through_probe(model, head, probe_session) -> float:
    """Task-B accuracy of ``model``'s encoder read through the probe's head."""
    probed = copy.deepcopy(model)
    probed.classifier = copy.deepcopy(head)
    return accuracy(probed.eval(), probe_session, probe_session.eval_data)


def run(out: Path, settings: Settings | None = None) -> dict:
    """Fit the probe, run every row for each seed, write ``results.json`` and ``results.md``.

    Args:
        out: Output folder.
        settings: Size of the comparison (default: 3 seeds, the demo's budget).

    Returns:
        The results written to ``results.json``.

    Raises:
        RankwiseError: On an unknown row.
    """
    s = settings or Settings()
    rows = chosen_rows("nanoadam-ft", s.rows, ROWS)
    out = Path(out)
    began = time.time()
    probe_base, head, probe_session = _probe(out, s)

    def one(row: str, seed: int) -> dict:
        metrics, session = run_row(with_settings(ROWS[row], s, seed), out / row / f"seed{seed}")
        after = _through_probe(session.model, head, probe_session)
        return {"seed": seed, "accuracy": metrics["eval_accuracy"], "task_b_accuracy": after,
                "forgetting": probe_base - after, **memory_record(session, metrics),
                "train_time_s": metrics["train_time_s"]}
    records = seeded_rows(rows, s.seeds, one)
    summary = summarise(records, ("accuracy", "forgetting", "task_b_accuracy", "state_bytes",
                                  "trainable_bytes", "peak_memory_mb", "train_time_s"))
    result = {"settings": s.__dict__, "rows": {r: ROWS[r] for r in rows}, "probe": PROBE,
              "task_b_packages": TASK_B_PACKAGES, "probe_accuracy_base": probe_base,
              "runs": records, "summary": summary, "wall_s": time.time() - began,
              "torch": torch.__version__}
    write_results(out, result, markdown(result))
    return result


def markdown(result: dict) -> str:
    """``results.md`` from the record: the mean ± std table over seeds."""
    md = ["# nanoadam-ft on the demo task\n",
          f"{result['settings']['seeds']} seed(s); mean ± sample std. Forgetting: task-B probe accuracy on the "
          f"base encoder ({pct(result['probe_accuracy_base'])}%) minus on the fine-tuned one (see the module "
          "docstring).\n",
          markdown_table(result["summary"], [
              ("accuracy", "demo accuracy (%)", pct), ("forgetting", "forgetting (points)", pct),
              ("task_b_accuracy", "task-B probe accuracy (%)", pct), ("state_bytes", "optimizer state MiB", mib),
              ("trainable_bytes", "trainable MiB", mib), ("peak_memory_mb", "peak MiB", lambda x: f"{x:.0f}"),
              ("train_time_s", "train s", lambda x: f"{x:.0f}")]), ""]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench nanoadam-ft --out DIR [--rows a,b] [--seeds N] [--steps N] ...``."""
    from rankwise_bench.common import demo_main
    return demo_main(run, tuple(ROWS), argv)


if __name__ == "__main__":
    import sys
    sys.exit(main())
