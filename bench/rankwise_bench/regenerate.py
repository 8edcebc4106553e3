"""Regenerate every committed ``bench/results/**/results.md`` from its own records.

    PYTHONPATH=bench python -m rankwise_bench.regenerate [--write]

Each benchmark renders ``results.md`` with its ``markdown(result)`` from the record it writes
beside it (``results.json``; ``continual`` reads its summary there too), and nothing else: no
measurement is run here. Without ``--write`` every folder is compared byte for byte and the
differing ones are listed (exit 1); with ``--write`` they are rewritten (after a change to a
``markdown`` function). :data:`FOLDERS` says which benchmark wrote each folder;
:data:`NOT_GENERATED` lists the committed ``results.md`` no benchmark writes, and why.
``tests/bench/test_regenerate.py`` holds the comparison.
"""
from __future__ import annotations

import importlib
import json
import sys
import tempfile
from pathlib import Path

from rankwise_bench import BENCHMARKS
from rankwise_bench.common import RESULTS

# results folder (relative to bench/results) -> the benchmark (rankwise bench NAME) that wrote it
FOLDERS = {
    "adapter-steps": "adapter-steps", "chunked-logprobs": "chunked-logprobs",
    "chunked-loss": "memory-features", "compress": "compress",
    "continual": "continual", "data-pipeline": "data-pipeline", "distill": "distill", "dpo": "dpo",
    "federated-demo": "federated-demo", "federated-demo/iid-check": "federated-demo",
    "federated-demo/issue27": "federated-demo", "federated-demo/issue34": "federated-demo",
    "federated-demo/long": "federated-demo", "federated-demo/natural": "federated-demo",
    "gguf-parity": "gguf-parity", "grpo": "grpo",
    "grpo-gain": "grpo-gain", "kto": "kto", "llm-finetune": "llm-finetune",
    "llm-finetune-dora": "llm-finetune", "llm-finetune-fused": "llm-finetune",
    "llm-finetune-fused/seq1024": "llm-finetune", "lora-vs-peft": "lora-vs-peft", "loro": "loro",
    "lota-qaf": "lota-qaf", "lowrank-pretrain": "lowrank-pretrain", "lowrank-pretrain-issue21": "lowrank-pretrain",
    **{f"lowrank-pretrain-8bit-seeds/{row}-seed{k}": "lowrank-pretrain" for row in ("adamw", "galore")
       for k in range(3)},
    "memory-decoder": "memory-decoder", "orpo": "orpo", "plan": "plan", "preference": "preference", "restore": "restore",
    "rloo": "rloo",
    "select": "select", "select-functions": "select-functions", "shapley": "shapley",
    "shapley-related": "shapley", "simpo": "simpo", "skrull": "skrull",
    "svdecode": "svdecode", "tpa": "tpa", "transfer": "transfer", "vfl": "vfl",
}

NOT_GENERATED = {
    "compare-demo": "written by `rankwise compare` (the library's commands/compare/run.py), not a benchmark; "
                    "an older table format than compare writes today",
    "compare-full": "written by `rankwise compare` (the library's commands/compare/run.py), not a benchmark; "
                    "an older table format than compare writes today",
    "compare-tuned": "written by `rankwise compare` (the library's commands/compare/run.py), not a benchmark; "
                     "the command in examples/compare-tuned.yaml rewrites it from the committed runs",
    **{f"lope-noisy-{level}": "written by `rankwise compare` (the library's commands/compare/run.py), not a "
                              "benchmark; the commands in examples/lope-noisy.yaml rewrite it from the committed runs"
       for level in (0, 40)},
    "federated-demo/alpha-sweep": "a hand summary of single FedIT runs (rankwise federated, the command "
                                  "it names) that chose the example's partition and budget",
    "lowrank-pretrain-8bit-seeds": "a summary written by hand from the six lowrank-pretrain runs below it "
                                   "(each of which regenerates)",
}


def _record(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def _federated(folder: Path) -> str:
    """``federated-demo``'s table through the library's own writer (``federated.run.write_results``),
    fed with run folders rebuilt from the record, in ``setup.json``'s strategy order."""
    from rankwise.federated.run import write_results
    rows = _record(folder)
    order = json.loads((folder / "setup.json").read_text())["strategies"]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for label in [s for s in order if s in rows] + [k for k in rows if k not in order]:
            r, run = rows[label], Path(tmp) / "runs" / str(len(runs))
            run.mkdir(parents=True)
            keys = ("strategy", "rounds", "bytes_up", "bytes_down", "bytes_total", "rejected", "failed", "missing",
                    "eval_accuracy", "eval_loss", "initial_eval_accuracy", "majority_accuracy", "wall_time_s")
            (run / "metrics.json").write_text(json.dumps({k: r[k] for k in keys if r.get(k) is not None}))
            (run / "rounds.jsonl").write_text("".join(
                json.dumps({k: v for k, v in e.items() if v is not None}) + "\n" for e in r["per_round"]))
            runs[label] = run
        write_results(runs, Path(tmp) / "out")
        return (Path(tmp) / "out" / "results.md").read_text()


def render(folder: Path) -> str:
    """The ``results.md`` that the benchmark of ``folder`` writes for the record there.

    Args:
        folder: A results folder named in :data:`FOLDERS`.

    Returns:
        The Markdown text.
    """
    name = FOLDERS[folder.relative_to(RESULTS).as_posix()]
    if name == "federated-demo":
        return _federated(folder)
    module = importlib.import_module(f"rankwise_bench.{BENCHMARKS[name].module}")
    return module.markdown(_record(folder))


def committed() -> list[Path]:
    """Every folder under ``bench/results`` holding a ``results.md``."""
    return sorted(p.parent for p in RESULTS.rglob("results.md"))


def differing() -> list[str]:
    """The generated folders whose ``results.md`` differs from :func:`render`'s, and the
    folders that neither :data:`FOLDERS` nor :data:`NOT_GENERATED` names."""
    out = []
    for folder in committed():
        rel = folder.relative_to(RESULTS).as_posix()
        if rel in NOT_GENERATED:
            continue
        if rel not in FOLDERS:
            out.append(f"{rel} (no benchmark named in FOLDERS)")
        elif render(folder) != (folder / "results.md").read_text():
            out.append(rel)
    return out


def main(argv: list[str] | None = None) -> int:
    """Compare (default) or rewrite (``--write``) every generated ``results.md``; the exit code is
    1 when one differs and was not rewritten."""
    args = sys.argv[1:] if argv is None else argv
    bad = differing()
    if "--write" in args:
        for rel in bad:
            if rel in FOLDERS:
                (RESULTS / rel / "results.md").write_text(render(RESULTS / rel))
                print(f"rewrote bench/results/{rel}/results.md")
        return 0
    for rel in bad:
        print(f"differs: bench/results/{rel}/results.md")
    print(f"{len(committed()) - len(NOT_GENERATED) - len(bad)} results.md regenerate byte for byte; "
          f"{len(bad)} differ; {len(NOT_GENERATED)} are not generated")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
