"""``rankwise bench select-functions``: targeted data selection on a causal LM.

The second measurement of issue 25's selection item, shaped like :mod:`rankwise_bench.select`
(the demo task) but on ``data.source: stdlib-functions`` (prompt = a docstring, completion = its
``def`` line, :mod:`rankwise.data.instruct`):

* base: the reference base (:func:`rankwise_bench.common.reference_base`, a 6.45M-parameter
  Llama pretrained on the standard library, with its SentencePiece tokenizer), fully fine-tuned
  for ``BASE_STEPS`` steps on the training records of every package **except** the target
  family, so it knows the task's shape but not the family's ``def`` lines. Decision (issue 35
  item 2): targeted selection is about adapting a model that already knows language, so the
  benchmark starts from the reference base; the former 2-layer, 64-wide Llama built in code with
  a byte-level BPE of 1,024 entries and its code are gone. (The base's pretraining read the
  family's source too, except its held-out modules: the paper's setting, a pretrained model, has
  seen such text.)
* target: ``TARGET_SIZE`` training records of the family ``TARGET`` (a seeded draw), taken out
  of the pool; the pool is every other training record (the family's remaining ones included);
* each method of ``data.select`` picks 5 / 10 / 20 % of the pool from the base + a fresh LoRA
  (r ``R`` on q/k/v/o, so the gradient features are LoRA's), and ``influence-warm`` picks with
  Influence Distillation after a ``WARMUP``-step LoRA warm-up; LoRA trains on the chosen records
  for ``STEPS`` steps;
* reported: held-out completion loss (nats per completion token) on the evaluation records of
  the family and on the whole evaluation split, the selection's seconds, and the share of chosen
  records from the family; a row ``base`` (no fine-tuning) and ``full`` (LoRA on the whole pool).

Pieces (``pieces/base.json``, ``pieces/seed<N>.json``) are written as each finishes and skipped
when present, so an interrupted run resumes; the base model lives in ``_work/`` (not committed).
Selection seconds are one process's wall time on a shared CPU, indicative only.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from rankwise_bench.select import BUDGETS, METHODS, RENAMED
from rankwise.core import atomic
from rankwise_bench.common import reference_base, write_results

TARGET = "email"
TARGET_SIZE = 32
BASE_STEPS, BASE_LR = 200, 5e-4
STEPS = 60
BATCH = 16
R = 8
SEEDS = 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# rows beyond data.select's rules: name -> (rule, its config's settings); each has its own
# feature cache. influence-warm: Influence Distillation's features after a LoRA warm-up (the
# release warms up first) of WARMUP steps at the training learning rate.
WARMUP = 20
EXTRA = {"influence-warm": ("influence", {"warmup_steps": WARMUP, "warmup_lr": 5e-3})}
ROWS = (*METHODS, *EXTRA)


def family(record_id: str) -> str:
    """The package family of a stdlib-functions id: ``email.mime.text:f:3`` -> ``email``."""
    return record_id.split(":", 1)[0].split(".", 1)[0]


def _raw(base: str, method: dict, steps: int, seed: int, select: dict | None = None, lr: float = 5e-3) -> dict:
    raw = {"model": {"path": base}, "task": {"name": "causal-lm"},
           "data": {"source": "stdlib-functions", "format": "prompt-completion", "max_length": 96,
                    "packing": False},
           "method": method, "optim": {"name": "adamw", "lr": lr},
           "train": {"steps": steps, "batch_size": BATCH, "eval_batch_size": 64, "seed": seed,
                     "progress": False, "threads": 1}}
    if select:
        raw["data"]["select"] = select
    return raw


def _lora() -> dict:
    return {"name": "lora", "r": R, "alpha": 2 * R, "targets": TARGETS}


def _losses(session) -> dict:
    from rankwise.engine.loop import evaluate
    from rankwise.recipes.select import record_ids
    ev = session.eval_data
    ids = record_ids(session.cfg.data, ev)
    fam = ev.subset([i for i, r in enumerate(ids) if family(r) == TARGET])
    f = lambda d: float(evaluate(session.model, session.task, d, 64, session.device)["eval_loss"])  # noqa: E731
    return {"target_loss": f(fam), "all_loss": f(ev), "target_eval": len(fam)}


def _quiet():
    from rich.console import Console
    return Console(stderr=True, quiet=True)


def _base(work: Path) -> dict:
    """Fine-tune the reference base fully on every non-target family; save it to ``work/base``."""
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.select import record_ids
    from rankwise.recipes.train import train
    from rankwise.recipes.session import prepare
    init = str(reference_base())
    probe = prepare(build_run_config(_raw(init, {"name": "full"}, 1, 0)), device="cpu")
    ids = record_ids(probe.cfg.data, probe.train_data)
    others = work / "base-select"
    others.mkdir(parents=True, exist_ok=True)
    (others / "chosen.json").write_text(json.dumps({"ids": [r for r in ids if family(r) != TARGET]}))
    cfg = build_run_config(_raw(init, {"name": "full"}, BASE_STEPS, 0, {"from": str(others)}, lr=BASE_LR))
    session = prepare(cfg, device="cpu")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp) / "run", session=session, console=_quiet(), summary=False)
    seconds = time.perf_counter() - start
    session.model.save_pretrained(work / "base")
    probe.tokenizer.save_pretrained(work / "base")
    return {"from": "bench/reference-base/model", "steps": BASE_STEPS, "lr": BASE_LR,
            "records": len(session.train_data), "train_s": round(seconds, 1),
            "params": sum(p.numel() for p in session.model.parameters()), **_losses(session)}


def _seed(base: Path, seed: int) -> dict:
    """Every method at every budget for one seed (features shared as in the demo bench), each
    selection trained; then the base and the whole-pool rows."""
    from rankwise import registry
    from rankwise.data.select import budget_count
    from rankwise.recipes import select as stage
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.train import train
    from rankwise.recipes.session import prepare
    cfg = build_run_config(_raw(str(base), _lora(), STEPS, seed))
    session = prepare(cfg, device="cpu")
    ids = stage.record_ids(cfg.data, session.train_data)
    fam = [i for i, r in enumerate(ids) if family(r) == TARGET]
    perm = torch.randperm(len(fam), generator=torch.Generator().manual_seed(seed)).tolist()
    picked = sorted(fam[j] for j in perm[:TARGET_SIZE])
    target, drop = session.train_data.subset(picked), set(picked)
    pool = [i for i in range(len(ids)) if i not in drop]
    rows = [{"method": "base", "budget": 0.0, "seed": seed, "k": 0, "seconds": 0.0, "target_share": None,
             **_losses(session)}]
    caches = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in ROWS:
            method, extra = EXTRA.get(row, (row, {}))
            sel_cfg = registry.get("select-rule", method).config_cls(seed=seed, **extra)
            cache = caches.setdefault(row if extra else "shared", {})
            for budget in BUDGETS:
                k = budget_count(budget, len(pool))
                cache["_used"] = set()
                before = dict(cache.get("_seconds", {}))
                start = time.perf_counter()
                _, chosen, _, _ = stage.score(session, sel_cfg, pool, target, k, cache)
                new = sum(v for key, v in cache.get("_seconds", {}).items() if key not in before)
                seconds = time.perf_counter() - start - new + sum(cache["_seconds"].get(key, 0.0)
                                                                  for key in cache["_used"])
                chosen_ids = [ids[pool[i]] for i in chosen]
                folder = Path(tmp) / f"{row}-{budget}"
                folder.mkdir()
                (folder / "chosen.json").write_text(json.dumps({"ids": chosen_ids}))
                rows.append({"method": row, "budget": budget, "seed": seed, "k": k, "seconds": seconds,
                             "target_share": sum(family(r) == TARGET for r in chosen_ids) / k,
                             **_fit(base, seed, folder, Path(tmp) / "run")})
        folder = Path(tmp) / "full"
        folder.mkdir()
        (folder / "chosen.json").write_text(json.dumps({"ids": [ids[i] for i in pool]}))
        rows.append({"method": "full", "budget": 1.0, "seed": seed, "k": len(pool), "seconds": 0.0,
                     "target_share": sum(family(ids[i]) == TARGET for i in pool) / len(pool),
                     **_fit(base, seed, folder, Path(tmp) / "run")})
    return {"seed": seed, "pool": len(pool), "target": len(target), "rows": rows}


def _fit(base: Path, seed: int, folder: Path, run: Path) -> dict:
    import shutil
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.train import train
    from rankwise.recipes.session import prepare
    cfg = build_run_config(_raw(str(base), _lora(), STEPS, seed, {"from": str(folder)}))
    session = prepare(cfg, device="cpu")
    train(cfg, run, session=session, console=_quiet(), summary=False)
    shutil.rmtree(run, ignore_errors=True)
    return _losses(session)


def run(out: Path, seeds: int = SEEDS) -> dict:
    """Every piece not yet recorded, then ``results.json``, ``results.md`` and ``loss.png``."""
    out = Path(out)
    work, pieces = out / "_work", out / "pieces"
    pieces.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    base_path = pieces / "base.json"
    if not base_path.is_file() or not (work / "base").is_dir():
        atomic.write_json(base_path, _base(work))
    base = json.loads(base_path.read_text())
    done = []
    for seed in range(seeds):
        path = pieces / f"seed{seed}.json"
        if not path.is_file():
            atomic.write_json(path, _seed(work / "base", seed))
        done.append(json.loads(path.read_text()))
    rows = [r for piece in done for r in piece["rows"]]
    result = {"setup": {"target": TARGET, "target_size": TARGET_SIZE, "budgets": BUDGETS, "steps": STEPS,
                        "batch": BATCH, "lora_r": R, "targets": TARGETS, "base": base,
                        "pool": done[0]["pool"] if done else None, "seeds": len(done)},
              "rows": rows, "mean": _means(rows)}
    write_results(out, result, markdown(result))
    _plot(result["mean"], out / "loss.png")
    return result


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench select-functions --out DIR [--seeds N]``."""
    from rankwise_bench.common import keyword_main
    return keyword_main(run, argv, "select-functions", seeds=(int, SEEDS))


def _means(rows: list[dict]) -> list[dict]:
    name = lambda r: RENAMED.get(r["method"], r["method"])  # noqa: E731
    keys = sorted({(name(r), r["budget"]) for r in rows}, key=lambda mb: (mb[1], mb[0]))
    out = []
    for method, budget in keys:
        rs = [r for r in rows if name(r) == method and r["budget"] == budget]
        t = torch.tensor([r["target_loss"] for r in rs], dtype=torch.float64)
        out.append({"method": method, "budget": budget, "k": rs[0]["k"], "n": len(rs),
                    "target_loss": float(t.mean()), "target_loss_std": float(t.std()) if len(rs) > 1 else 0.0,
                    "all_loss": sum(r["all_loss"] for r in rs) / len(rs),
                    "target_share": None if rs[0]["target_share"] is None
                    else sum(r["target_share"] for r in rs) / len(rs),
                    "seconds": sum(r["seconds"] for r in rs) / len(rs)})
    return out


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    s = res["setup"]
    lines = [f"Target family `{s['target']}` ({s['target_size']} training records out of the pool of "
             f"{s['pool']}), LoRA r {s['lora_r']} on {'/'.join(s['targets'])}, {s['steps']} steps of {s['batch']}, "
             f"{s['seeds']} seed(s); loss = held-out completion loss (nats/token), mean ± std over seeds.", "",
             "| method | budget | k | target loss | all loss | target share | select s |",
             "|---|---|---|---|---|---|---|"]
    for r in res["mean"]:
        share = "" if r["target_share"] is None else f"{r['target_share']:.2f}"
        lines.append(f"| {r['method']} | {r['budget']:.2f} | {r['k']} | {r['target_loss']:.3f} ± "
                     f"{r['target_loss_std']:.3f} | {r['all_loss']:.3f} | {share} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def _plot(means: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for method in ROWS:
        pts = sorted((r["budget"], r["target_loss"], r["target_loss_std"]) for r in means if r["method"] == method)
        ax.errorbar([p[0] * 100 for p in pts], [p[1] for p in pts], [p[2] for p in pts], marker="o",
                    capsize=2, label=method)
    for name, style in (("full", "--"), ("base", ":")):
        v = [r["target_loss"] for r in means if r["method"] == name]
        if v:
            ax.axhline(v[0], color="0.5", ls=style, label="whole pool" if name == "full" else "base")
    ax.set_xlabel("budget (% of the pool)")
    ax.set_ylabel(f"held-out loss on {TARGET}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
