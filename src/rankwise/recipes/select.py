"""The selection stage of a run (``data.select``).

:func:`select_training` runs after the data is tokenized and the method is applied (LESS,
Influence Distillation and the QCS proxy need the adapted model's gradients), before packing and the
optimizer: it computes the features the rules of :mod:`rankwise.data.select` score, picks the
budget, and replaces the session's training data by the chosen records (weighted when
``weights: true``). ``rankwise select`` (:mod:`rankwise.commands.select.run`) writes what it
chose.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rankwise.data import select as rules
from rankwise.data.select import WeightedData
from rankwise.errors import RankwiseError
from rankwise.recipes.select_features import (grad_features, jvp_embeddings,  # noqa: F401
                                              sentence_embeddings, trainable, warm_up)


@dataclass
class Selection:
    """What a selection chose.

    Attributes:
        method: The rule (or ``from:DIR``).
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
    """Run rule ``cfg.method``: ``(scores over the pool, chosen pool indices, weights, token weights)``.

    ``cache`` (a dict kept by the caller) keeps the features between calls with other budgets.
    """
    model, task, data, dev = session.model, session.task, session.train_data, session.device
    memo = {} if cache is None else cache

    def once(key, fn):  # memo["_seconds"]: seconds per feature; memo["_used"]: keys this call read
        memo.setdefault("_used", set()).add(key)
        if key not in memo:
            start = time.perf_counter()
            memo[key] = fn()
            memo.setdefault("_seconds", {})[key] = time.perf_counter() - start
        return memo[key]
    grad_features_ = lambda d, idx, name: once(name, lambda: grad_features(  # noqa: E731
        model, task, d, idx, cfg.proj_dim, cfg.seed, dev))
    if cfg.method == "random":
        s = rules.random_scores(len(pool), cfg.seed)
        return s, rules.top_k(s, k), None, None
    if cfg.method == "embedding":
        tok = session.tokenizer
        text = lambda d, i: tok.decode(d[i]["input_ids"], skip_special_tokens=True)  # noqa: E731
        e = once("emb", lambda: sentence_embeddings([text(data, i) for i in pool], dev))
        t = e if target is None else once("emb_t", lambda: sentence_embeddings(
            [text(target, i) for i in range(len(target))], dev))
        s = (e @ t.T).max(1).values
        return s, rules.top_k(s, k), None, None
    if not trainable(model):
        raise RankwiseError(f"data.select.method {cfg.method!r} needs a model with trainable weights; "
                            "choose a method such as lora, or data.select.method: embedding/random")
    was = model.training
    saved = warm_up(model, task, data, pool, cfg, dev) if cfg.warmup_steps else None
    model.eval()
    try:
        t_idx = list(range(len(target)))
        g_t = grad_features_(target, t_idx, "g_t")
        if cfg.method == "less":
            s = rules.less_scores(grad_features_(data, pool, "g"), g_t)
            return s, rules.top_k(s, k), None, None
        if cfg.method == "influence":
            land = sorted(torch.randperm(len(pool), generator=torch.Generator().manual_seed(cfg.seed))
                          [: min(cfg.landmarks, len(pool))].tolist())
            g_l = grad_features_(data, [pool[i] for i in land], "g_l")
            emb = once("jvp", lambda: jvp_embeddings(model, task, data, pool, cfg.jvp_tangents, cfg.seed, dev))
            p = rules.influence_scores(emb, land, g_l, g_t, cfg.ridge)                 # (n, m)
            chosen = rules.round_robin(p, k, cfg.seed)
            s = p.mean(1)
            w = rules.influence_weights(p[chosen], k, cfg.influence_eta, cfg.influence_l2) if cfg.weights else None
            return s, chosen, w, None
        g = grad_features_(data, pool, "g")
        w = rules.qcs_probabilities(g, g_t, k, cfg.qcs_steps, cfg.qcs_samples, cfg.qcs_lr, cfg.qcs_eta, cfg.seed)
        chosen = rules.top_k(w, k)
        tw = _token_weights(session, cfg, [pool[i] for i in chosen]) if cfg.weights else None
        return w, chosen, (w[chosen] if cfg.weights else None), tw
    finally:
        if saved is not None:
            with torch.no_grad():
                for (_, p), v in zip(trainable(model), saved):
                    p.copy_(v)
                    p.grad = None
        model.train(was)


@torch.no_grad()
def _token_weights(session, cfg, idx: list[int]):
    """Per-token weights of the chosen examples (causal LM): tokens ranked by their loss under the
    current model, the top ``token_ratio`` kept (the qcs-proxy's fixed stand-in for QCS's learned
    token masks)."""
    if session.task.uses_labels:
        return None
    from rankwise.data.select import token_weights as rule
    scores = []
    for i in idx:
        batch = {k: v.to(session.device) for k, v in session.task.collate([session.train_data[i]],
                                                                        session.train_data.pad_id).items()}
        logits = session.model(input_ids=batch["input_ids"]).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, batch["input_ids"][0, 1:], reduction="none")
        scores.append(torch.cat([torch.zeros(1), nll.cpu()]))  # token 0 is never predicted
    return [w.tolist() for w in rule(scores, cfg.token_ratio, cfg.token_floor)]


def _mean_one(w) -> list[float]:
    w = torch.as_tensor(w, dtype=torch.float64)
    return (w * len(w) / w.sum().clamp_min(1e-30)).tolist()


def select_training(session) -> Selection:
    """Apply ``data.select`` to the session: choose records, replace ``session.train_data``.

    Raises:
        RankwiseError: A budget <= 0 or above the pool size, an empty target, a rule that needs
            trainable weights on a model without them, or a ``from`` folder that does not match.
    """
    cfg, start = session.cfg.data.select, time.perf_counter()
    if cfg.method in rules.ALIASES:
        new = rules.ALIASES[cfg.method]
        print(f"notice: data.select.method {cfg.method!r} is now {new!r}: a one-step quadratic proxy of "
              "QCS, not the paper's bi-level method (docs/select.md); write method: qcs-proxy", file=sys.stderr)
        cfg = dataclasses.replace(cfg, method=new)
    if cfg.weights and session.cfg.data.packing:
        raise RankwiseError("data.select.weights: packed blocks cannot carry per-example weights; set "
                            "data.packing: false or data.select.weights: false")
    ids_all = record_ids(session.cfg.data, session.train_data)
    if cfg.from_:
        sel = _reuse(cfg, ids_all)
    else:
        pool, target = target_split(session, cfg)
        try:
            k = rules.budget_count(cfg.budget, len(pool))
        except ValueError as err:
            raise RankwiseError(str(err)) from None
        s, chosen, w, tw = score(session, cfg, pool, target, k)
        sel = Selection(cfg.method, [ids_all[i] for i in pool], [float(x) for x in s],
                        [pool[i] for i in chosen], None if w is None else _mean_one(w), tw,
                        info={"pool": len(pool), "target": 0 if target is None else len(target), "k": k})
        sel.chosen = sorted(sel.chosen)
    sel.seconds = time.perf_counter() - start
    chosen_data = session.train_data.subset(sel.chosen)
    if cfg.weights and (sel.weights or sel.token_weights):
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
