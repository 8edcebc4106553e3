"""``rankwise bench shapley --setting related``: Model Shapley's top-10 % neuron fine-tuning in the
paper's setting, a model already fine-tuned on related data, on the reference base.

The paper (docs/inspect.md, "Model Shapley") fine-tunes only the top 10 % of an instruction-tuned
LLM's neurons to inject knowledge (MMLU) and reports it ahead of the first-order scores and level
with full fine-tuning. The demo-task run of ``bench shapley`` scored a MiniLM whose task head was
new, where that setting is absent. Here (our reading of "related"; decision of issue 36 item 2):

* the task is ``data.source: stdlib-functions`` (prompt = a standard-library function's
  docstring, completion = its ``def`` line, :mod:`rankwise.data.instruct`), split by package
  family (:func:`split_records`): the **target** is one family (``email``: its records sorted by
  id, every ``test_every``-th is test, every ``val_every``-th of the rest validation, the others
  training), the **related** data is every other family's records (the same task on other
  packages, none of the target's functions);
* **stage 1** (run once, kept in ``OUT/_work/related``, not committed): full fine-tuning of the
  reference base (:func:`rankwise_bench.common.reference_base`) on the related records, so the
  model knows the task's format but not the target's ``def`` lines, as an instruction-tuned
  model knows the answer format before knowledge is injected;
* **stage 2**, from that model: ``method: {name: full, select: S, fraction: 0.1}`` for S in
  shapley / grad / grad_weight / random, scored on ``calibration_batches`` batches of the
  target's training records (no task head exists: only the chosen rows of the block linear
  layers move; embeddings and norms are frozen), and full fine-tuning, each for ``steps`` steps
  of ``batch_size`` at every learning rate of ``lrs`` on seed 0; the one with the lower
  validation loss is then trained on the other seeds (``random`` draws its neurons with the
  run's seed). Reported on the test records: completion loss per token and per byte (nats /
  UTF-8 bytes of the scored completion pieces), token accuracy and exact match (every
  completion token the argmax: what greedy decoding reproduces), with the stage-1 model and the
  reference base as the "no stage 2" rows.

Every stage-2 run is a piece (``OUT/pieces/START/ROW/lrLR-seedK.json``, with its chosen
neurons) reused when the settings it depends on match, so a killed run continues; stage 1 is
retrained only when a missing piece needs it (its own piece records what it measured).
``starts`` can add ``base`` (the same rows from the reference base without stage 1).

Size (issue 36: at most 30 minutes of one shared core): timed first at smoke size (10 stage-2
steps took ~25 s a run with its scoring and evaluation, stage 1 ~2 s a step), so the committed
run has 120 stage-1 steps, 32 stage-2 steps and a 2-point learning-rate grid; it took 170 s for
stage 1 and 43-92 s for each of the 20 stage-2 runs (one run's wall time includes a pause of the
process by another session).
"""
from __future__ import annotations

import copy
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rankwise.core import atomic
from rankwise_bench.common import reference_base, write_results
from rankwise_bench.shapley_related_report import markdown, plot

ROWS = ("top10-shapley", "top10-grad", "top10-grad_weight", "top10-random", "full")
LABELS = {"top10-shapley": "top 10 % by Model Shapley", "top10-grad": "top 10 % by Σ|g|",
          "top10-grad_weight": "top 10 % by Σ|g⊙θ|", "top10-random": "random 10 %", "full": "full fine-tuning"}


@dataclass
class Sizes:
    """What sets the benchmark's size (default: the committed run).

    Attributes:
        base: The causal LM to start from (``None``: the reference base); tests pass a tiny one.
        target: The package family that is the target task.
        test_every: Every n-th target record (sorted by id) is a test record.
        val_every: Every n-th of the remaining target records is a validation record.
        max_length: Tokens per example (a longer prompt is cut from the left).
        batch_size: Examples per step, both stages.
        related_steps: Stage-1 steps (full fine-tuning on the related records).
        related_lr: Stage-1 AdamW learning rate.
        steps: Stage-2 steps, the same for every row.
        lrs: Stage-2 AdamW learning rates swept on seed 0 (chosen on validation per row).
        fraction: Share of the neurons the ``top10-*`` rows train.
        calibration_batches: Batches of target training records the scores are computed on.
        rows: Stage-2 rows (of :data:`ROWS`).
        seeds: Seeds per row.
        starts: ``related`` (stage 1's model) and/or ``base`` (the base without stage 1).
        threads: torch intra-op threads.
    """

    base: str | None = None
    target: str = "email"
    test_every: int = 4
    val_every: int = 5
    max_length: int = 96
    batch_size: int = 16
    related_steps: int = 120
    related_lr: float = 1e-3
    steps: int = 32
    lrs: tuple = (1e-3, 3e-3)
    fraction: float = 0.1
    calibration_batches: int = 4
    rows: tuple = ROWS
    seeds: int = 3
    starts: tuple = ("related",)
    threads: int = 1


def family(record_id: str) -> str:
    """The package family of a stdlib-functions id: ``email.mime.text:f:3`` -> ``email``."""
    return record_id.split(":", 1)[0].split(".", 1)[0]


def split_records(records: list[dict], target: str, test_every: int, val_every: int) -> dict[str, list[dict]]:
    """The related / target train / validation / test records (deterministic, no draw).

    Args:
        records: ``{"prompt", "completion", "id"}`` records.
        target: The target package family.
        test_every: Every n-th target record (sorted by id) is test.
        val_every: Every n-th of the other target records is validation.

    Returns:
        ``{"related", "train", "val", "test"}``: related = every record of another family.

    Raises:
        RankwiseError: When the target family has too few records for the three splits.
    """
    from rankwise.errors import RankwiseError
    mine = sorted((r for r in records if family(r["id"]) == target), key=lambda r: r["id"])
    test = [r for i, r in enumerate(mine) if i % test_every == test_every - 1]
    rest = [r for i, r in enumerate(mine) if i % test_every != test_every - 1]
    val = [r for i, r in enumerate(rest) if i % val_every == val_every - 1]
    train = [r for i, r in enumerate(rest) if i % val_every != val_every - 1]
    if not (test and val and train):
        raise RankwiseError(f"target {target!r} has {len(mine)} records: too few for test / validation / "
                            "training; choose another --set target=FAMILY")
    return {"related": [r for r in records if family(r["id"]) != target], "train": train, "val": val, "test": test}


def _write_splits(s: Sizes, folder: Path) -> dict[str, int]:
    """Write the four splits as JSONL files in ``folder``; return their sizes."""
    from rankwise.data.instruct import load_function_records
    splits = split_records(load_function_records(), s.target, s.test_every, s.val_every)
    folder.mkdir(parents=True, exist_ok=True)
    for name, recs in splits.items():
        atomic.write_bytes(folder / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in recs).encode())
    return {k: len(v) for k, v in splits.items()}


def _raw(s: Sizes, data: Path, init: str, source: str, method: dict, lr: float, steps: int, seed: int) -> dict:
    return {"model": {"path": init, "dtype": "float32"}, "task": {"name": "causal-lm"},
            "data": {"source": str(data / f"{source}.jsonl"), "eval_source": str(data / "test.jsonl"),
                     "format": "prompt-completion", "max_length": s.max_length},
            "method": method, "optim": {"name": "adamw", "lr": lr},
            "train": {"steps": steps, "batch_size": s.batch_size, "eval_batch_size": 64, "seed": seed,
                      "eval_every": 0, "save_every": 0, "log_every": 5, "warmup_fraction": 0.05,
                      "calibration_batches": s.calibration_batches, "progress": False, "threads": s.threads}}


def _method(row: str, s: Sizes, seed: int) -> dict:
    if row == "full":
        return {"name": "full"}
    return {"name": "full", "select": row.removeprefix("top10-"), "fraction": s.fraction, "seed": seed}


def _split(session, data: Path, name: str):
    """The encoded records of ``data/NAME.jsonl`` (as the run's evaluation split would be)."""
    from rankwise.data.text import build_data
    cfg = copy.deepcopy(session.cfg.data)
    cfg.source = cfg.eval_source = str(data / f"{name}.jsonl")
    return build_data(cfg, session.task, session.tokenizer)[1]


def scores(session, data: Path, names=("val", "test")) -> dict:
    """``{split: {loss, nats_per_byte, token_accuracy, exact_match, examples}}`` of the session's
    model: loss per completion token, and the same nats over the UTF-8 bytes of the scored pieces."""
    from rankwise.engine import evaluate
    from rankwise_bench.base_text import piece_bytes
    table = piece_bytes(session.tokenizer)
    out = {}
    for name in names:
        split = _split(session, data, name)
        m = evaluate(session.model, session.task, split, 64, session.device)
        labels = [row["labels"][1:] for row in split.rows(list(range(len(split))))]
        targets = sum(1 for lab in labels for t in lab if t != -100)
        nbytes = sum(table[t] for lab in labels for t in lab if t != -100)
        out[name] = {"loss": float(m["eval_loss"]), "nats_per_byte": float(m["eval_loss"]) * targets / max(nbytes, 1),
                     "token_accuracy": float(m["eval_token_accuracy"]), "exact_match": float(m["eval_exact_match"]),
                     "examples": len(split), "targets": targets, "bytes": nbytes}
    return out


def _quiet():
    from rich.console import Console
    return Console(stderr=True, quiet=True)


def _session(raw: dict):
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.session import prepare
    cfg = build_run_config(copy.deepcopy(raw))
    return cfg, prepare(cfg, device="cpu")


def _setting(s: Sizes) -> dict:
    """The sizes every stage-2 piece depends on (not the lists of rows, seeds and starts)."""
    return {k: v for k, v in asdict(s).items() if k not in ("rows", "seeds", "starts", "threads", "lrs")}


STAGE1 = ("base", "target", "test_every", "val_every", "max_length", "batch_size", "related_steps", "related_lr")


def _stage1(s: Sizes, work: Path, pieces: Path) -> Path:
    """The related model (``work/related``), trained here when absent or made with other sizes;
    its piece is written once."""
    from rankwise.recipes.train import train
    model, setting = work / "related", {k: getattr(s, k) for k in STAGE1}
    made = model / "stage1.json"
    if made.is_file() and json.loads(made.read_text()) == setting:
        return model
    shutil.rmtree(model, ignore_errors=True)
    init = s.base or str(reference_base())
    raw = _raw(s, work / "data", init, "related", {"name": "full"}, s.related_lr, s.related_steps, 0)
    cfg, session = _session(raw)
    before = scores(session, work / "data", ("test",))["test"]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp) / "run", session=session, console=_quiet(), summary=False)
    seconds = time.perf_counter() - start
    after = scores(session, work / "data", ("val", "test"))
    shutil.rmtree(model.with_suffix(".tmp"), ignore_errors=True)
    session.model.save_pretrained(model.with_suffix(".tmp"))
    session.tokenizer.save_pretrained(model.with_suffix(".tmp"))
    (model.with_suffix(".tmp") / "stage1.json").write_text(json.dumps(setting))
    model.with_suffix(".tmp").rename(model)
    path = pieces / "related.json"
    if not path.is_file() or json.loads(path.read_text()).get("setting") != setting:
        atomic.write_json(path, {"setting": setting, "records": len(session.train_data), "train_s": seconds,
                                 "base_on_target": before, "after": after})
    return model


def _selection(session, row: str) -> dict | None:
    sel = session.method_result
    if row == "full" or sel is None:
        return None
    mods = dict(session.model.named_modules())
    weights = sum(len(v) * mods[p].in_features for p, v in sel.neurons.items())
    return {"neurons": sel.neurons, "count": sum(len(v) for v in sel.neurons.values()), "weights": weights}


def _one(s: Sizes, work: Path, init: Path, row: str, lr: float, seed: int) -> dict:
    """One stage-2 run: train on the target's training records, score validation and test."""
    from rankwise.recipes.train import train
    raw = _raw(s, work / "data", str(init), "train", _method(row, s, seed), lr, s.steps, seed)
    t0 = time.perf_counter()
    cfg, session = _session(raw)
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp) / "run", session=session, console=_quiet(), summary=False)
    wall = time.perf_counter() - t0
    trainable = sum(p.numel() for p in session.model.parameters() if p.requires_grad)
    return {"row": row, "lr": lr, "seed": seed, "wall_s": wall, "requires_grad_params": trainable,
            "selection": _selection(session, row), **scores(session, work / "data")}


def _piece(s: Sizes, out: Path, start: str, row: str, lr: float, seed: int, init) -> dict:
    path = out / "pieces" / start / row / f"lr{lr:g}-seed{seed}.json"
    if path.is_file():
        rec = json.loads(path.read_text())
        if rec.get("setting") == _setting(s):
            return rec
    rec = {"setting": _setting(s), "start": start, **_one(s, out / "_work", init(), row, lr, seed)}
    atomic.write_json(path, rec)
    return rec


def run(out: Path, sizes: Sizes | None = None, command: str | None = None) -> dict:
    """Every missing piece (stage 1 first when one needs it), then ``results.json/md/png``.

    Args:
        out: The results folder.
        sizes: The size (default :class:`Sizes`).
        command: The command line to record.

    Returns:
        The record written to ``results.json``.

    Raises:
        RankwiseError: On an unknown row or start, or a target family too small to split.
    """
    from rankwise.errors import RankwiseError
    s = sizes or Sizes()
    bad = [r for r in s.rows if r not in ROWS] + [t for t in s.starts if t not in ("related", "base")]
    if bad:
        raise RankwiseError(f"shapley --setting related: unknown rows/starts {bad}; rows are {list(ROWS)}, "
                            "starts related and base")
    out = Path(out)
    work, pieces = out / "_work", out / "pieces"
    split_sizes = _write_splits(s, work / "data")
    began, torch_threads = time.time(), torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        inits = {"related": lambda: _stage1(s, work, pieces), "base": lambda: Path(s.base or reference_base())}
        runs: dict[str, dict[str, list[dict]]] = {}
        for start in s.starts:
            for row in s.rows:
                sweep = [_piece(s, out, start, row, lr, 0, inits[start]) for lr in s.lrs]
                best = min(sweep, key=lambda r: r["val"]["loss"])
                rest = [_piece(s, out, start, row, best["lr"], k, inits[start]) for k in range(1, s.seeds)]
                runs.setdefault(start, {})[row] = {"sweep": sweep, "seeds": [best, *rest]}
        stage1 = json.loads((pieces / "related.json").read_text()) if (pieces / "related.json").is_file() else None
    finally:
        torch.set_num_threads(torch_threads)
    result = {"command": command, "sizes": asdict(s), "splits": split_sizes, "stage1": stage1,
              "summary": summarise(runs), "overlap": overlaps(runs), "runs": _slim(runs),
              "wall_s": time.time() - began, "torch": torch.__version__}
    write_results(out, result, markdown(result))
    plot(result, out / "results.png")
    return result


def _slim(runs: dict) -> dict:
    """The per-run records without the neuron lists (those stay in the pieces)."""
    def slim(r: dict) -> dict:
        sel = r.get("selection")
        return {**{k: v for k, v in r.items() if k not in ("selection", "setting")},
                "selected": None if sel is None else {"count": sel["count"], "weights": sel["weights"]}}
    return {st: {row: {"sweep": [slim(r) for r in v["sweep"]], "seeds": [slim(r) for r in v["seeds"]]}
                 for row, v in rows.items()} for st, rows in runs.items()}


def summarise(runs: dict) -> dict:
    """``{start: {row: {lr, n, metric: [mean, sample std]}}}`` over the seeds at the chosen rate."""
    keys = [("test", "loss"), ("test", "nats_per_byte"), ("test", "token_accuracy"), ("test", "exact_match"),
            ("val", "loss")]
    out: dict = {}
    for start, rows in runs.items():
        for row, v in rows.items():
            recs = v["seeds"]
            stats = {"lr": recs[0]["lr"], "n": len(recs), "wall_s": statistics.fmean(r["wall_s"] for r in recs)}
            for split, k in keys:
                vals = [r[split][k] for r in recs]
                stats[f"{split}_{k}"] = [statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0]
            out.setdefault(start, {})[row] = stats
    return out


def overlaps(runs: dict) -> dict:
    """Per start and seed, the share of Model Shapley's chosen neurons that each other score
    also chose, and the share of each score's neurons in the MLP (gate/up/down) layers."""
    out: dict = {}
    for start, rows in runs.items():
        sets = {row: [_neurons(r) for r in v["seeds"]] for row, v in rows.items() if row != "full"}
        mine = sets.get("top10-shapley")
        out[start] = {
            "with_shapley": {row: [len(a & b) / max(len(a), 1) for a, b in zip(mine, got)]
                             for row, got in sets.items() if row != "top10-shapley"} if mine else {},
            "mlp_share": {row: [sum(1 for p, _ in g if p.split(".")[-1] in ("gate_proj", "up_proj", "down_proj"))
                                / max(len(g), 1) for g in got] for row, got in sets.items()}}
    return out


def _neurons(rec: dict) -> set:
    sel = rec.get("selection") or {}
    return {(p, i) for p, rows in (sel.get("neurons") or {}).items() for i in rows}


PRESETS = {"default": Sizes(),
           "smoke": Sizes(related_steps=4, steps=3, lrs=(1e-3,), seeds=1, calibration_batches=1,
                          rows=("top10-shapley", "full"))}


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench shapley --setting related --out DIR [--preset P] [--set FIELD=VALUE ...]``."""
    from rankwise_bench.common import preset_main
    preset_main(argv, name="shapley --setting related", doc=__doc__, presets=PRESETS, default="default", run=run)
    return 0
