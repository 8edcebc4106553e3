"""The harness every benchmark of ``rankwise_bench`` shares.

- Where things are: the checkout (:data:`ROOT`), the committed results (:data:`RESULTS`), the
  reference base (:func:`reference_base`) and the environment of worker processes
  (:func:`worker_env`, so a ``python -m rankwise_bench.<module>`` child imports this package).
- Settings and rows: :class:`Settings` (the size of a demo-task comparison), :func:`chosen_rows`,
  :func:`with_settings`, and the two command lines the benchmarks take beyond ``--out``:
  :func:`demo_main` (``--rows/--seeds/--steps``) and :func:`preset_main` (``--preset/--set``).
- The run skeleton: :func:`torch_threads` around the measurement, :func:`seeded_rows` (every row
  of a demo comparison for every seed, through ``rankwise train``'s pipeline: :func:`run_row`),
  and the one results writer :func:`write_results` (``results.json`` + ``results.md``, which
  each benchmark's ``markdown(result)`` renders from the record alone, so a committed
  ``results.md`` regenerates from its ``results.json``: :mod:`rankwise_bench.regenerate`).
- The one tiny-Llama builder :func:`llama`; the standard-library corpus is :mod:`.corpus`.
"""
from __future__ import annotations

import contextlib
import copy
import json
import numbers
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from rankwise.core import atomic
from rankwise.errors import RankwiseError

BENCH = Path(__file__).resolve().parents[1]     # bench/ of the checkout
ROOT = BENCH.parent                             # the checkout
RESULTS = BENCH / "results"                     # the committed results, one folder per benchmark run
REFERENCE_BASE = BENCH / "reference-base" / "model"

# The demo task at the budget of examples/compare-demo.yaml: the packaged MiniLM, stdlib
# docstrings of 8 packages, 40 steps x 32 examples, sequences of 32 tokens.
DEMO_BASE = {
    "model": {"path": "demo"},
    "task": {"name": "classification"},
    "data": {"source": "demo", "max_length": 32, "eval_fraction": 0.2},
    "train": {"steps": 40, "batch_size": 32, "eval_batch_size": 128, "eval_every": 0, "save_every": 0,
              "log_every": 5, "warmup_fraction": 0.05, "progress": False},
}


def reference_base() -> Path:
    """The reference base's folder, ``bench/reference-base/model``: a small Llama that rankwise
    pretrained on the standard library (``bench/reference-base/pretrain.yaml``), with its card.

    Raises:
        RankwiseError: When it is not built yet (one line naming ``make reference-base``).
    """
    if not (REFERENCE_BASE / "config.json").is_file():
        raise RankwiseError(f"the reference base is not built ({REFERENCE_BASE} has no config.json): "
                            "run `make reference-base` in the checkout (pretrains it on CPU, 1-2 hours)")
    return REFERENCE_BASE


def worker_env(**extra: str) -> dict[str, str]:
    """``os.environ`` for a worker process of a benchmark (``python -m rankwise_bench.<module>``,
    also under torchrun), with ``bench/`` first on ``PYTHONPATH`` and ``extra`` set.

    Returns:
        The environment for ``subprocess.run(..., env=...)``.
    """
    path = os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads (``None``: leave them), then restore."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _plain(x: Any) -> Any:
    """A JSON value for what ``json`` cannot write: numpy/torch scalars as numbers, else ``str``."""
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def ordered(mapping: dict, first: Any) -> dict:
    """``mapping`` with the keys of ``first`` in that order, then the others as they come.

    A record written with sorted keys (``rankwise.core.atomic.write_json``) lost the order its
    rows were run in; a ``markdown(result)`` puts them back in the benchmark's own order with
    this, so a committed ``results.md`` regenerates from its ``results.json``.
    """
    keys = [k for k in first if k in mapping] + [k for k in mapping if k not in first]
    return {k: mapping[k] for k in keys}


def write_json(path: Path, obj: Any) -> None:
    """Write a record atomically: indented JSON in the record's own key order."""
    atomic.write_bytes(path, (json.dumps(obj, indent=1, default=_plain) + "\n").encode())


def write_results(out: Path, result: dict, markdown: str) -> None:
    """The one results writer: ``out/results.json`` (the record) and ``out/results.md`` (its
    rendering), each written atomically.

    Args:
        out: The results folder (created).
        result: The record.
        markdown: ``results.md``'s text, rendered from ``result``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result)
    atomic.write_bytes(out / "results.md", markdown.encode())


def llama(vocab: int, hidden: int, layers: int, heads: int, intermediate: int, *, positions: int,
          kv_heads: int | None = None, seed: int = 0, device: str | None = None, **config: Any) -> nn.Module:
    """The benchmarks' one Llama builder: a ``LlamaForCausalLM`` with seeded random float32 weights.

    Args:
        vocab, hidden, layers, heads, intermediate: The shape.
        positions: ``max_position_embeddings``.
        kv_heads: Key/value heads (``None``: as many as ``heads``).
        seed: ``torch.manual_seed`` right before the weights are drawn.
        device: Create the weights there (``"meta"`` counts parameters for free; ``None``: the default).
        **config: Further ``LlamaConfig`` fields (token ids, ``tie_word_embeddings``, ``use_cache``).

    Returns:
        The model (training mode).
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads if kv_heads is None else kv_heads,
                      max_position_embeddings=positions, **config)
    if device is None:
        return LlamaForCausalLM(cfg)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


@dataclass
class Settings:
    """The size of a demo comparison (tests and smoke runs shrink it).

    Attributes:
        seeds: Seeds per row (``train.seed`` = 0..seeds-1).
        steps: Training steps (``None``: the base config's).
        model: ``model.path`` (``None``: the base config's; ``tiny-bert`` for smoke tests).
        limit: ``data.limit`` (training records), ``None`` for all.
        rows: Rows to run (``None``: the benchmark's default rows).
    """

    seeds: int = 3
    steps: int | None = None
    model: str | None = None
    limit: int | None = None
    rows: tuple[str, ...] | None = None


def chosen_rows(bench: str, requested: Any, known: dict,
                default: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The rows to run: ``requested`` (default: ``default``, else every known row), each checked.

    Raises:
        RankwiseError: Naming the rows ``bench`` does not know.
    """
    rows = tuple(requested or default or known)
    unknown = [r for r in rows if r not in known]
    if unknown:
        raise RankwiseError(f"{bench} rows: got {unknown}; expected some of {list(known)}")
    return rows


def with_settings(raw: dict, s: Settings, seed: int) -> dict:
    """``raw`` with the settings' size and ``train.seed = seed`` applied (a copy)."""
    out = copy.deepcopy(raw)
    out.setdefault("train", {})["seed"] = seed
    if s.steps is not None:
        out["train"]["steps"] = s.steps
        if "total_steps" in out.get("optim", {}):
            out["optim"]["total_steps"] = s.steps
    if s.model is not None:
        out.setdefault("model", {})["path"] = s.model
    if s.limit is not None:
        out.setdefault("data", {})["limit"] = s.limit
    return out


def run_row(raw: dict, out: Path, base_hook: Callable[[nn.Module], Any] | None = None):
    """Train one run as ``rankwise train`` would, after ``base_hook(model)`` changed the loaded
    base (e.g. quantized it); reuses a finished run with the same plan.

    Returns:
        ``(metrics, session)``; the session holds the trained model and the optimizer.
    """
    from rich.console import Console

    from rankwise.engine import get_task
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.model import load_model
    from rankwise.recipes.train import train
    from rankwise.recipes.session import prepare
    cfg = build_run_config(copy.deepcopy(raw))
    task = get_task(cfg.task.name)
    model = tok = None
    if base_hook is not None:
        from rankwise.data.demo import PACKAGES
        labels = cfg.model.num_labels or (len(PACKAGES) if cfg.data.source == "demo" else None)
        model, tok = load_model(cfg.model.path, task, labels, seed=cfg.train.seed)
        base_hook(model)
    session = prepare(cfg, model=model, tokenizer=tok)
    metrics = train(cfg, out, session=session, console=Console(stderr=True, quiet=True), summary=False)
    return metrics, session


def seeded_rows(rows: tuple[str, ...], seeds: int, one: Callable[[str, int], dict],
                rows_first: bool = True) -> dict[str, list[dict]]:
    """The skeleton of a demo comparison: ``one(row, seed)`` for every row and seed.

    Args:
        rows: The rows, in order.
        seeds: Seeds per row (``0..seeds-1``).
        one: Runs one (row, seed) and returns its record.
        rows_first: Every seed of a row, then the next row (``False``: every row at seed 0 first).

    Returns:
        ``{row: [record per seed]}``.
    """
    records: dict[str, list[dict]] = {}
    order = ([(r, k) for r in rows for k in range(seeds)] if rows_first
             else [(r, k) for k in range(seeds) for r in rows])
    for row, seed in order:
        records.setdefault(row, []).append(one(row, seed))
    return records


def accuracy(model: nn.Module, session, data=None) -> float:
    """``eval_accuracy`` of ``model`` on ``data`` (default: the session's evaluation split)."""
    from rankwise.engine import evaluate
    data = session.eval_data if data is None else data
    return float(evaluate(model, session.task, data, session.cfg.train.eval_batch_size,
                          session.device)["eval_accuracy"])


def memory_record(session, metrics: dict) -> dict:
    """Bytes of the model's storage (packed codes count packed), of its trainable weights and
    of the optimizer state, with the run's peak memory."""
    from rankwise.memory import tensor_bytes
    from rankwise.optim.common import state_bytes
    trainable = [p for p in session.model.parameters() if p.requires_grad]
    return {"model_bytes": tensor_bytes(session.model),
            "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable),
            "state_bytes": state_bytes(session.optimizer),
            "peak_memory_mb": metrics.get("peak_memory_mb"), "memory_meter": metrics.get("memory_meter")}


def summarise(records: dict[str, list[dict]], keys: tuple[str, ...]) -> dict[str, dict]:
    """``{row: {key: (mean, sample std)}}`` over seeds."""
    out = {}
    for row, recs in records.items():
        out[row] = {}
        for k in keys:
            vals = [float(r[k]) for r in recs if r.get(k) is not None]
            if vals:
                out[row][k] = (statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0)
    return out


def markdown_table(summary: dict[str, dict], columns: list[tuple[str, str, Callable[[float], str]]]) -> str:
    """A Markdown table of ``mean ± std`` cells: ``columns`` is ``[(key, header, format)]``."""
    lines = ["| row | " + " | ".join(h for _, h, _ in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for row, stats in summary.items():
        cells = []
        for key, _, fmt in columns:
            if key in stats:
                mean, std = stats[key]
                cells.append(f"{fmt(mean)} ± {fmt(std)}")
            else:
                cells.append("-")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pct(x: float) -> str:
    """``0.734`` -> ``"73.4"``."""
    return f"{100 * x:.1f}"


def mib(x: float) -> str:
    """Bytes as MiB with two decimals."""
    return f"{x / 2**20:.2f}"


def command_line(name: str, argv: list[str]) -> str:
    """The command recorded in a result: ``rankwise bench NAME ARGS`` (shell-quoted)."""
    import shlex
    return " ".join(["rankwise bench", name, *(shlex.quote(a) for a in argv)])


def keyword_main(run: Callable[..., Any], argv: list[str] | None, name: str,
                 **options: tuple[type, Any]) -> int:
    """The command line of a benchmark whose ``run(out, **options)`` takes a few keywords:
    ``--out DIR`` and ``--<option> VALUE`` for each (``--lr 0.003``); a user error ends with one
    line and exit code 2.

    Args:
        run: The benchmark's ``run``.
        argv: The arguments (``None``: ``sys.argv[1:]``).
        name: The benchmark's name (``rankwise bench NAME``).
        **options: ``{keyword: (type, default)}``.

    Returns:
        The exit code.
    """
    import argparse
    import sys
    ap = argparse.ArgumentParser(prog=f"rankwise bench {name}")
    ap.add_argument("--out", required=True)
    for key, (kind, default) in options.items():
        ap.add_argument(f"--{key.replace('_', '-')}", dest=key, type=kind, default=default,
                        help=f"default {default}")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(Path(a.out), **{k: getattr(a, k) for k in options})
    except RankwiseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}/results.json and {a.out}/results.md")
    return 0


def demo_main(run: Callable[[Path, Settings], dict], rows: tuple[str, ...], argv: list[str] | None = None) -> int:
    """Command line of a demo comparison: ``--out DIR [--rows a,b] [--seeds N] [--steps N]
    [--model PATH] [--limit N]``; user errors end with one line and exit code 2.

    Args:
        run: The benchmark's ``run(out, settings)``.
        rows: Its row names (for the help text).
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code.
    """
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="rankwise bench")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=None, help=f"comma-separated rows of {list(rows)}")
    ap.add_argument("--seeds", type=int, default=Settings.seeds)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--limit", type=int, default=None)
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    chosen = tuple(r.strip() for r in a.rows.split(",") if r.strip()) if a.rows else None
    try:
        run(Path(a.out), Settings(a.seeds, a.steps, a.model, a.limit, chosen))
    except RankwiseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}/results.json and {a.out}/results.md")
    return 0


def preset_main(argv: list[str] | None, *, name: str, doc: str, presets: dict[str, Any],
                default: str, run: Callable[..., dict],
                show: Callable[[dict], str] | None = None) -> dict:
    """The command line of a benchmark that runs from a preset of sizes, ``--out DIR [--preset P]
    [--set FIELD=VALUE ...]``: ``--set`` overrides a copy of the preset's sizes dataclass, then
    ``run(out, sizes, command=...)``.

    Args:
        argv: The arguments (``None``: ``sys.argv[1:]``).
        name: The benchmark's name (for the recorded command, ``rankwise bench NAME ...``).
        doc: The benchmark's description (its module docstring).
        presets: ``{name: sizes dataclass instance}``.
        default: The preset used without ``--preset``.
        run: The benchmark's ``run(out, sizes, command=...)``.
        show: Renders the results to print afterwards (``None``: print nothing).

    Returns:
        The results dict; a user error prints one line and exits 2, as the rankwise command.
    """
    import argparse
    import dataclasses
    import sys

    import yaml
    parser = argparse.ArgumentParser(prog=f"rankwise bench {name}", description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", choices=sorted(presets), default=default)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a sizes field (YAML value), e.g. --set layers=4")
    args = parser.parse_args(argv)
    sizes = copy.deepcopy(presets[args.preset])
    names = {f.name for f in dataclasses.fields(sizes)}
    for item in args.sets:
        key, _, raw = item.partition("=")
        if key not in names:
            parser.error(f"--set {item!r}: unknown field; fields: {', '.join(sorted(names))}")
        value = yaml.safe_load(raw)
        setattr(sizes, key, tuple(value) if isinstance(value, list) else value)
    command = command_line(name, argv if argv is not None else sys.argv[1:])
    try:
        res = run(args.out, sizes, command=command)
    except RankwiseError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if show is not None:
        print(show(res))
    return res
