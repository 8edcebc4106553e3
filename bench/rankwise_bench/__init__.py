"""rankwise's benchmarks against its peers, outside the installed package.

Run one from a source checkout (the folder holding ``bench/``)::

    rankwise bench NAME [--out DIR] [options]               # the rankwise command finds bench/ here
    PYTHONPATH=bench python -m rankwise_bench NAME [...]    # the same without it

``--out`` defaults to ``bench/results/NAME``. With ``--out`` alone a benchmark runs at the size its
committed results were measured at; the options after NAME beyond ``--out`` are the benchmark's
own (``--preset``/``--set``, ``--rows``, ``--seeds`` ...; ``rankwise bench NAME --help`` lists
them) for the benchmarks in :data:`BENCHMARKS` that take any. Every benchmark writes
``results.json`` (the record) and ``results.md`` (its ``markdown(result)``, so the committed
Markdown regenerates from the record: ``python -m rankwise_bench.regenerate``), through
the harness in :mod:`rankwise_bench.common`. Nothing in ``rankwise`` imports this package.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Benchmark:
    """One entry of :data:`BENCHMARKS`.

    Attributes:
        module: The module under ``rankwise_bench`` (``lowrank_pretrain``).
        run: Its function ``run(out)`` that runs the benchmark at its committed size.
        cli: Its command line ``main(argv)`` (``--out DIR`` plus the benchmark's own options),
            or ``None`` when the benchmark takes only ``--out``.
    """

    module: str
    run: str = "run"
    cli: str | None = None


BENCHMARKS: dict[str, Benchmark] = {
    "adapter-steps": Benchmark("adapter_steps"),
    "chunked-logprobs": Benchmark("chunked_logprobs"),
    "compress": Benchmark("compress", cli="main"),
    "continual": Benchmark("continual"),
    "data-pipeline": Benchmark("data_pipeline"),
    "distill": Benchmark("distill"),
    "dpo": Benchmark("dpo"),
    "federated-demo": Benchmark("federated_demo"),
    "forgetting": Benchmark("forgetting", cli="main"),
    "gguf-parity": Benchmark("gguf_parity", cli="main"),
    "grpo": Benchmark("grpo"),
    "grpo-gain": Benchmark("grpo_gain", cli="main"),
    "kto": Benchmark("kto"),
    "llm-finetune": Benchmark("llm_finetune", cli="main"),
    "llm-finetune-dora": Benchmark("llm_finetune", run="run_dora"),
    "llm-finetune-fused": Benchmark("llm_finetune", run="run_fused"),
    "lora-vs-peft": Benchmark("lora_vs_peft"),
    "loro": Benchmark("loro"),
    "lota-qaf": Benchmark("lota_qaf", cli="main"),
    "lowrank-pretrain": Benchmark("lowrank_pretrain", cli="main"),
    "memory-decoder": Benchmark("memory_decoder", cli="main"),
    "memory-features": Benchmark("memory_features", cli="main"),
    "nanoadam-ft": Benchmark("nanoadam_ft", cli="main"),
    "offload": Benchmark("offload", cli="main"),
    "orpo": Benchmark("reference_free", run="run_orpo"),
    "plan": Benchmark("plan", cli="main"),
    "preference": Benchmark("preference"),
    "restore": Benchmark("restore", cli="main"),
    "rloo": Benchmark("rloo"),
    "select": Benchmark("select", cli="main"),
    "select-functions": Benchmark("select_functions", cli="main"),
    "shapley": Benchmark("shapley", cli="main"),
    "simpo": Benchmark("reference_free", run="run_simpo"),
    "skrull": Benchmark("skrull"),
    "svdecode": Benchmark("svdecode"),
    "tpa": Benchmark("tpa"),
    "transfer": Benchmark("transfer"),
    "vfl": Benchmark("vfl"),
}

USAGE = "usage: rankwise bench NAME [--out DIR] [options]  (or: PYTHONPATH=bench python -m rankwise_bench NAME ...)"


def _function(module: str, name: str):
    return getattr(importlib.import_module(f"rankwise_bench.{module}"), name)


def _split_out(args: list[str]) -> tuple[str | None, list[str]]:
    """``(--out's value or None, the other arguments)``."""
    out, rest, i = None, [], 0
    while i < len(args):
        if args[i] == "--out" and i + 1 < len(args):
            out, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--out="):
            out = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    return out, rest


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark ``argv[0]`` (``NAME [--out DIR] [options]``); list them without one.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code (0, or the benchmark command line's own code: 2 for a user error there).

    Raises:
        RankwiseError: An unknown benchmark, or options given to one that takes only ``--out``
            (the rankwise command prints it in one line; ``python -m rankwise_bench`` too).
    """
    from rankwise.errors import RankwiseError, closest
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "--list"):
        print(USAGE + "\n\nbenchmarks: " + ", ".join(BENCHMARKS))
        return 0
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        raise RankwiseError(f"rankwise bench: no benchmark {name!r}{closest(name, BENCHMARKS)}; "
                            f"choose from {', '.join(BENCHMARKS)}")
    entry = BENCHMARKS[name]
    given, options = _split_out(rest)
    out = given or str(Path("bench") / "results" / name)
    if options and entry.cli is not None:   # the benchmark's own command line (its --help too)
        code = _function(entry.module, entry.cli)(rest if given else ["--out", out, *rest])
        return code if isinstance(code, int) else 0
    if options in (["-h"], ["--help"]):
        print(f"usage: rankwise bench {name} [--out DIR]  (default: bench/results/{name})")
        return 0
    if options:
        raise RankwiseError(f"rankwise bench {name} takes only --out DIR; got {' '.join(options)}")
    _function(entry.module, entry.run)(Path(out))
    print(f"wrote {out}/results.json and {out}/results.md")
    return 0


__all__ = ["BENCHMARKS", "Benchmark", "main"]
