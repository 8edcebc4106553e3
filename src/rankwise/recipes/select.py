"""The selection stage of a run (``data.select``).

:func:`select_training` runs after the data is tokenized and the method is applied (LESS,
Influence Distillation and the QCS proxy need the adapted model's gradients), before packing and the
optimizer: it splits the pool from the target, runs the chosen rule's registered scoring function
(kind ``select-rule``, :mod:`rankwise.recipes.select_rules`) for the budget, and replaces the
session's training data by the chosen records (weighted when ``weights: true``). ``rankwise select`` (:mod:`rankwise.commands.select.run`) writes what it
chose.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rankwise import registry
from rankwise.data import select as rules
from rankwise.data.select import WeightedData
from rankwise.errors import RankwiseError
from rankwise.recipes.select_features import Features
from rankwise.recipes.select_rules import SelectInputs


@dataclass
class Selection:
    """What a selection chose.

    Attributes:
        method: The rule's name (or ``from:DIR``).
        ids: Record id of every pool example (the training split minus target examples).
        scores: Score of every pool example.
        chosen: Pool indices kept, increasing.
        weights: Weight of each chosen example (mean 1), or ``None``.
        token_weights: Per-token weights of each chosen example (qcs-proxy, causal LM), or ``None``.
        seconds: Time the selection took (features + rule).
    """

    method: str
    ids: list[str]
    scores: list[float]
    chosen: list[int]
    weights: list[float] | None = None
    token_weights: list[list[float]] | None = None
    seconds: float = 0.0
    info: dict = field(default_factory=dict)


def record_ids(data_cfg, data) -> list[str]:
    """The record id of each example of ``data`` (an ``ArrowData`` over the encoded source):
    the source's ``id`` field when it has one, else the row number."""
    rows = data.positions.tolist()
    from rankwise.data.text import BUILTIN, builtin_dataset
    if data_cfg.source in BUILTIN:
        ids = builtin_dataset(data_cfg.source)["id"]
    else:
        from rankwise.data.files import read_dataset
        raw = read_dataset(data_cfg.source, data_cfg.cache_dir)
        ids = raw["id"] if "id" in raw.column_names else None
    return [str(ids[r]) if ids is not None else str(r) for r in rows]


def _demo_packages(spec: str, data_cfg) -> set[str]:
    from rankwise.data.demo import PACKAGES
    if data_cfg.source != "demo":
        raise RankwiseError(f"data.select.target: {spec!r} filters the demo data but data.source is "
                            f"{data_cfg.source!r}; name a target file instead")
    pkgs = {p.strip() for p in spec.split(":", 1)[1].split(",") if p.strip()}
    bad = sorted(pkgs - set(PACKAGES))
    if not pkgs or bad:
        raise RankwiseError(f"data.select.target: {spec!r} names no demo package ({bad or 'empty'}); "
                            f"expected demo:PKG[,PKG] from {list(PACKAGES)}")
    return pkgs


def target_split(session, cfg) -> tuple[list[int], Any]:
    """``(pool indices into the training data, target examples)``.

    ``demo:PKG,...``: ``target_size`` training records of those packages (seeded draw), taken
    out of the pool. A file: encoded like ``data.source``. Target examples whose tokens equal an
    evaluation example are dropped with a warning.

    Raises:
        RankwiseError: An empty target (after dropping the overlap).
    """
    train, spec, n = session.train_data, cfg.target, len(session.train_data)
    if spec is None:
        return list(range(n)), None
    if spec.startswith("demo:"):
        from rankwise.data.demo import load_demo_records
        pkgs, records = _demo_packages(spec, session.cfg.data), load_demo_records()[0]
        cand = [i for i, r in enumerate(train.positions.tolist()) if records[r]["package"] in pkgs]
        perm = torch.randperm(len(cand), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        picked = sorted(cand[j] for j in perm[: cfg.target_size])
        target = train.subset(picked)
        drop = set(picked)
        pool = [i for i in range(n) if i not in drop]
    else:
        from rankwise.data.text import ArrowData, _encode, encoder_for
        d = session.cfg.data
        ds = _encode(spec, d, encoder_for(d, session.task, session.tokenizer), session.task.uses_labels)
        lens = np.asarray(ds["_len"])
        target = ArrowData(ds, np.flatnonzero(lens > 0), train.label_names, getattr(train, "label_index", {}),
                           train.pad_id, d.format)
        pool = list(range(n))
    evals = {tuple(session.eval_data[i]["input_ids"]) for i in range(len(session.eval_data))}
    keep = [i for i in range(len(target)) if tuple(target[i]["input_ids"]) not in evals]
    if len(keep) < len(target):
        print(f"warning: data.select.target: {len(target) - len(keep)} of {len(target)} target examples "
              "equal evaluation examples; dropped them", file=sys.stderr)
        target = target.subset(keep)
    if not len(target):
        raise RankwiseError(f"data.select.target: {spec!r} gives no target examples (after dropping "
                            "those in the evaluation split); choose other data")
    return pool, target


def score(session, cfg, pool: list[int], target, k: int, cache: dict | None = None
          ) -> tuple[torch.Tensor, list[int], Any, Any]:
    """Run the rule ``cfg.name`` (its registered scoring function, kind ``select-rule``):
    ``(scores over the pool, chosen pool indices, weights, token weights)``.

    ``cache`` (a dict kept by the caller) keeps the features between calls with other budgets.
    """
    rule = registry.get("select-rule", cfg.name).builder
    out = rule(cfg, SelectInputs(session, pool, target, k, Features(session, cache)))
    return out.scores, out.chosen, out.weights, out.token_weights


def _mean_one(w) -> list[float]:
    w = torch.as_tensor(w, dtype=torch.float64)
    return (w * len(w) / w.sum().clamp_min(1e-30)).tolist()


def select_training(session) -> Selection:
    """Apply ``data.select`` to the session: choose records by its rule (or reuse those of its
    ``from`` folder), replace ``session.train_data``.

    Raises:
        RankwiseError: A budget <= 0 or above the pool size, an empty target, a rule that needs
            trainable weights on a model without them, or a ``from`` folder that does not match.
    """
    cfg, start = session.cfg.data.select, time.perf_counter()
    weighted = bool(getattr(cfg, "weights", False))
    if weighted and session.cfg.data.packing:
        raise RankwiseError("data.select.weights: packed blocks cannot carry per-example weights; set "
                            "data.packing: false or data.select.weights: false")
    ids_all = record_ids(session.cfg.data, session.train_data)
    if getattr(cfg, "from_", None):
        sel = _reuse(cfg, ids_all)
    else:
        pool, target = target_split(session, cfg)
        try:
            k = rules.budget_count(cfg.budget, len(pool))
        except ValueError as err:
            raise RankwiseError(str(err)) from None
        s, chosen, w, tw = score(session, cfg, pool, target, k)
        sel = Selection(cfg.name, [ids_all[i] for i in pool], [float(x) for x in s],
                        [pool[i] for i in chosen], None if w is None else _mean_one(w), tw,
                        info={"pool": len(pool), "target": 0 if target is None else len(target), "k": k})
        sel.chosen = sorted(sel.chosen)
    sel.seconds = time.perf_counter() - start
    chosen_data = session.train_data.subset(sel.chosen)
    if weighted and (sel.weights or sel.token_weights):
        chosen_data = WeightedData(chosen_data, sel.weights, sel.token_weights)
    session.train_data = chosen_data
    return sel


def _reuse(cfg, ids_all: list[str]) -> Selection:
    folder = Path(cfg.from_)
    path = folder / "chosen.json"
    if not path.is_file():
        raise RankwiseError(f"data.select.from: {folder} has no chosen.json; point it at a folder "
                            "written by rankwise select")
    saved = json.loads(path.read_text())
    where = {r: i for i, r in enumerate(ids_all)}
    missing = [r for r in saved["ids"] if r not in where]
    if missing:
        raise RankwiseError(f"data.select.from: {len(missing)} chosen ids (e.g. {missing[0]!r}) are not "
                            "in this run's training data; select again for this data")
    order = sorted(range(len(saved["ids"])), key=lambda j: where[saved["ids"][j]])
    chosen = [where[saved["ids"][j]] for j in order]
    weights = None if saved.get("weights") is None else [saved["weights"][j] for j in order]
    tw = None if saved.get("token_weights") is None else [saved["token_weights"][j] for j in order]
    return Selection(f"from:{folder}", [], [], chosen, weights, tw, info={"k": len(chosen)})
