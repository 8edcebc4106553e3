"""The inference rules of ``rankwise continual`` (HRM-PET, :mod:`rankwise.commands.continual.run`):
initial matching (keys or the trained task-identity classifier), direct re-matching, and the
confidence-based re-matching at the configured and at a validation-tuned threshold.

Every rule is scored on the same trained modules, so the rules differ only in which module
each example is run with (docs/continual.md).
"""
from __future__ import annotations

import torch

from rankwise.commands.continual.maths import (candidate_tasks, confidence, direct_rematch, gate_score,
                                     match_keys, task_keys, tune_threshold)

MATCHERS = ("tii", "keys")
STEPS = ("match", "direct", "hrm", "hrm-tuned")


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits with every class outside ``allowed`` (a class mask) set to -inf."""
    return logits.masked_fill(~allowed, float("-inf"))


def rows_of(batch: dict, idx: torch.Tensor) -> dict:
    """The rows ``idx`` of every tensor of ``batch``."""
    return {k: v[idx] for k, v in batch.items()}


class EvalCache:
    """Logits per (module, example) of one batch, each computed once.

    Args:
        net: The continual model (``forward(batch, module_name)``).
        batch: The tokenized examples.
        chunk: Examples per forward.
    """

    def __init__(self, net, batch: dict, chunk: int = 64):
        self.net, self.batch, self.chunk, self.rows = net, batch, chunk, {}

    @torch.no_grad()
    def logits(self, modules: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``(len(ids), C)`` logits of example ``ids[k]`` under module ``modules[k]``."""
        out = [None] * len(ids)
        for m in modules.unique().tolist():
            have = self.rows.setdefault(m, {})
            todo = sorted({int(i) for i, mm in zip(ids, modules) if int(mm) == m and int(i) not in have})
            for s in range(0, len(todo), self.chunk):
                part = torch.tensor(todo[s:s + self.chunk])
                for i, row in zip(part.tolist(), self.net.forward(rows_of(self.batch, part), f"task{m}")):
                    have[i] = row.float()
            for k, (i, mm) in enumerate(zip(ids.tolist(), modules.tolist())):
                if mm == m:
                    out[k] = have[i]
        return torch.stack(out)


def hybrid_rematch(cfg, get, matched: torch.Tensor, class_task: torch.Tensor, allowed: torch.Tensor,
                   multi: bool, tau: float | None = None) -> dict[str, torch.Tensor]:
    """Predictions of every inference rule from the matched modules.

    Args:
        cfg: The ``ContinualConfig`` (``gate``, ``tau``, ``candidates``, ``temperature``).
        get: ``get(modules, rows) -> logits`` of the given rows under the given modules.
        matched: Initially matched module per example.
        class_task: Task of each class.
        allowed: Mask of the classes seen so far.
        multi: More than one task seen (the code re-matches by confidence only then).
        tau: Gate threshold (``None``: ``cfg.tau``).

    Returns:
        ``{"match", "direct", "hrm"}`` -> predicted class per example; ``"rematched"``: the
        confidence-based choice for every example (what ``hrm`` takes where the gate fires);
        ``"score"``: the gate score of the initial logits; ``"unsure"``: where the gate fired.
    """
    tau = cfg.tau if tau is None else tau
    rows = torch.arange(len(matched))
    first = masked(get(matched, rows), allowed)
    direct_mod, switched = direct_rematch(matched, first, class_task)
    second = first.clone()
    if switched.any():
        second[switched] = masked(get(direct_mod[switched], rows[switched]), allowed)
    score = gate_score(first, cfg.gate)
    rematched = second.argmax(-1)
    if multi:
        k = min(cfg.candidates, int(allowed.sum()))
        cands = candidate_tasks(first, class_task, k)                  # (n, k)
        options = [second] + [masked(get(cands[:, j], rows), allowed) for j in range(k)]
        stack = torch.stack(options, dim=1)                            # (n, 1 + k, C)
        best = confidence(stack, cfg.temperature).argmax(-1)
        rematched = stack[rows, best].argmax(-1)
    unsure = (score < tau) if multi else torch.zeros_like(switched)
    return {"match": first.argmax(-1), "direct": second.argmax(-1),
            "hrm": torch.where(unsure, rematched, second.argmax(-1)), "rematched": rematched,
            "score": score, "unsure": unsure, "switched": switched}


def matchers(t: int, key_feats: list, tii, feats: torch.Tensor, class_task: torch.Tensor,
             seen: torch.Tensor) -> dict[str, torch.Tensor]:
    """Initially matched task per example under each matcher, after task ``t``.

    Args:
        t: Index of the last task trained.
        key_feats: Frozen features of each task's key examples.
        tii: The trained :class:`~rankwise.commands.continual.maths.TaskIdentity`.
        feats: Frozen features of the examples to match.
        class_task: Task of each class.
        seen: Mask of the classes seen so far.
    """
    keys = task_keys(torch.cat(key_feats[:t + 1]),
                     torch.cat([torch.full((len(f),), j) for j, f in enumerate(key_feats[:t + 1])]), t + 1)
    return {"keys": match_keys(feats, keys), "tii": tii.match(feats, class_task, seen)}


def score_point(cfg, t: int, match_eval: dict, match_val: dict, eval_cache: EvalCache, val_cache: EvalCache,
                eval_y: torch.Tensor, val_y: torch.Tensor, class_task: torch.Tensor,
                seen: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Predictions of every (matcher, rule) on the evaluation rows, with ``tau`` tuned per
    matcher on the validation rows (:func:`~rankwise.commands.continual.maths.tune_threshold`: the
    threshold with the best validation accuracy of the ``hrm`` rule; nothing to tune while
    one task is seen, or without validation rows).

    Returns:
        ``({"<matcher>:<rule>": predictions}, {matcher: counts})``.
    """
    preds, counts = {}, {}
    for name in MATCHERS:
        out = hybrid_rematch(cfg, eval_cache.logits, match_eval[name], class_task, seen, t > 0)
        tuned = cfg.tau
        if t > 0 and len(val_y):
            v = hybrid_rematch(cfg, val_cache.logits, match_val[name], class_task, seen, True)
            tuned, _ = tune_threshold(v["score"], v["rematched"] == val_y, v["direct"] == val_y)
        fired = (out["score"] < tuned) if t > 0 else torch.zeros_like(out["unsure"])
        for rule in ("match", "direct", "hrm"):
            preds[f"{name}:{rule}"] = out[rule]
        preds[f"{name}:hrm-tuned"] = torch.where(fired, out["rematched"], out["direct"])
        counts[name] = {"switched": int(out["switched"].sum()), "unsure": int(out["unsure"].sum()),
                        "unsure_tuned": int(fired.sum()), "tau_tuned": tuned,
                        "score_min": float(out["score"].min()), "score_max": float(out["score"].max())}
    return preds, counts


__all__ = ["EvalCache", "MATCHERS", "STEPS", "hybrid_rematch", "masked", "matchers", "rows_of", "score_point"]
