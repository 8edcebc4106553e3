"""``rankwise continual CONFIG --tasks ...``: continual learning with one LoRA module per task
(HRM-PET, Wei et al. 2025; the maths: :mod:`rankwise.core.continual`; docs/continual.md).

The packaged MiniLM classifier of the demo task (:mod:`rankwise.data.demo`) stays frozen; the
eight standard-library packages are split into tasks (``--tasks asyncio,email/http,importlib``:
tasks separated by ``/``, classes by ``,``) learned one after the other without stored
exemplars. Methods (``continual.method``):

* ``hrm-pet``: a LoRA adapter per task (its classes' rows of the shared head train with it; the
  logits of other classes are masked while a task trains, so earlier rows do not move), trained
  with cross-entropy + ``distill_weight`` x CTIRD against the features of up to
  ``distill_modules`` earlier modules; at inference key matching, then the hybrid re-matching;
* ``key-match``: the same modules without CTIRD, chosen by key matching alone (L2P/CODA-style);
* ``sequential``: one adapter trained task after task (the forgetting baseline);
* ``joint``: one adapter trained on all tasks at once (the upper bound).

Evaluation is class-incremental: after each task, the evaluation examples of every task seen so
far, scored over the classes seen so far. Per-task-module methods report every inference rule
(``match``, ``direct`` re-matching only, ``hrm`` = direct + confidence-based, ``oracle`` = the
true task's module, i.e. task-incremental), so the rules are compared on the same modules.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from rankwise.core.continual import (candidate_tasks, confidence, direct_rematch, low_confidence,
                                     match_keys, relation_distillation, task_keys)
from rankwise.errors import RankwiseError

METHODS = ("hrm-pet", "key-match", "sequential", "joint")
RULES = ("match", "direct", "hrm", "oracle")
# the 4 x 2 split of the demo's packages used by `rankwise bench continual`
DEMO_TASKS = "asyncio,email/http,importlib/logging,multiprocessing/tkinter,xml"


@dataclass
class ContinualConfig:
    """How ``rankwise continual`` trains and evaluates (the one place its defaults live).

    Attributes:
        method: ``hrm-pet``, ``key-match``, ``sequential`` or ``joint`` (module docstring).
        model: ``model.path`` of the classifier (``demo``: the packaged MiniLM; ``tiny-bert``
            for smoke tests).
        steps_per_task: Optimizer steps per task (``joint``: this times the number of tasks).
        batch_size: Training examples per step.
        lr: AdamW learning rate of the adapters (no weight decay: masked head rows must not move).
        head_lr: AdamW learning rate of the classification head (new weights: the demo's
            frozen-encoder rate).
        r: LoRA rank of each task module (``alpha = 2 r``, every linear layer but the head).
        max_length: Tokens per docstring.
        eval_fraction: Share of the records held out (the demo's hash split).
        eval_per_class: Evaluation examples per class (the first ones by id).
        key_examples: Training examples per task whose mean frozen feature is its key.
        tau: Confidence-based re-matching runs on examples whose initial max softmax
            probability is below ``tau`` (the code's ``msp`` rule).
        temperature: ``T`` of the confidence score ``T logsumexp(l / T)`` (code: 0.1).
        candidates: Tasks of the top-``candidates`` classes of the initial prediction are tried
            (code: 2).
        distill_weight: Weight of the CTIRD loss (code's ``--con``: 0.1).
        distill_modules: Earlier modules that teach CTIRD, the most recent first (code's ``K``: 5).
        seed: Seeds the head, the adapters and the batch order.
    """

    method: str = "hrm-pet"
    model: str = "demo"
    steps_per_task: int = 10
    batch_size: int = 16
    lr: float = 3e-3
    head_lr: float = 2e-2
    r: int = 8
    max_length: int = 32
    eval_fraction: float = 0.2
    eval_per_class: int = 25
    key_examples: int = 64
    tau: float = 0.8
    temperature: float = 0.1
    candidates: int = 2
    distill_weight: float = 0.1
    distill_modules: int = 5
    seed: int = 0

    def check(self) -> None:
        """Raise a one-line RankwiseError naming the first bad setting."""
        if self.method not in METHODS:
            raise RankwiseError(f"continual.method {self.method!r}: expected one of {list(METHODS)}")
        for name in ("steps_per_task", "batch_size", "r", "max_length", "eval_per_class",
                     "key_examples", "candidates"):
            if getattr(self, name) < 1:
                raise RankwiseError(f"continual.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.eval_fraction < 1:
            raise RankwiseError(f"continual.eval_fraction must be in (0, 1), got {self.eval_fraction}")


def load_config(path: Path | None, overrides: dict | None = None) -> ContinualConfig:
    """``ContinualConfig`` from a YAML file (keys at top level or under ``continual:``)."""
    import yaml
    raw = {}
    if path is not None:
        if not Path(path).is_file():
            raise RankwiseError(f"config {path} not found: give a YAML file of continual keys")
        raw = yaml.safe_load(Path(path).read_text()) or {}
        raw = raw.get("continual", raw)
    raw.update(overrides or {})
    known = {f.name for f in fields(ContinualConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise RankwiseError(f"unknown continual key(s) {unknown}; known: {sorted(known)}")
    cfg = ContinualConfig(**raw)
    cfg.check()
    return cfg


def parse_tasks(spec: str | list[str], classes: tuple[str, ...]) -> list[list[str]]:
    """Tasks from ``"a,b/c,d"`` (or a list of ``"a,b"``), each class a name in ``classes``.

    Raises:
        RankwiseError: On an unknown class, an empty task, a class in two tasks, or fewer
            than two tasks.
    """
    parts = spec.split("/") if isinstance(spec, str) else [p for s in spec for p in s.split("/")]
    tasks = [[c.strip() for c in p.split(",") if c.strip()] for p in parts]
    for i, t in enumerate(tasks):
        if not t:
            raise RankwiseError(f"--tasks: task {i + 1} has no classes; write classes separated by ',' "
                                "and tasks by '/', e.g. asyncio,email/http,importlib")
        bad = [c for c in t if c not in classes]
        if bad:
            raise RankwiseError(f"--tasks: unknown class {bad[0]!r} in task {i + 1}; known: {list(classes)}")
    seen = [c for t in tasks for c in t]
    if len(seen) != len(set(seen)):
        dup = next(c for c in seen if seen.count(c) > 1)
        raise RankwiseError(f"--tasks: class {dup!r} is in two tasks; each class belongs to one task")
    if len(tasks) < 2:
        raise RankwiseError(f"--tasks: continual learning needs at least 2 tasks, got {len(tasks)}; "
                            "separate tasks with '/'")
    return tasks


class _Data:
    """Tokenized demo records of the tasks' classes: training pools, evaluation set, frozen
    features of the key and evaluation examples."""

    def __init__(self, cfg: ContinualConfig, tasks: list[list[str]], tok):
        from rankwise.data.demo import PACKAGES, load_demo_records, split_of
        records, _ = load_demo_records(PACKAGES)
        self.classes = [c for t in tasks for c in t]          # label = position here
        label = {c: i for i, c in enumerate(self.classes)}
        self.class_task = torch.tensor([i for i, t in enumerate(tasks) for _ in t])
        train, evals = {c: [] for c in self.classes}, {c: [] for c in self.classes}
        for r in records:
            if r["package"] in label:
                (evals if split_of(r["id"], cfg.eval_fraction) == "eval" else train)[r["package"]].append(r)
        for c in self.classes:
            if not train[c] or not evals[c]:
                raise RankwiseError(f"class {c!r} has no training or evaluation docstrings on this Python")
        ev = [r for c in self.classes for r in evals[c][:cfg.eval_per_class]]
        self.eval_ids, self.eval_y = self._encode(tok, ev, cfg.max_length), torch.tensor([label[r["package"]] for r in ev])
        self.train = {}
        for ti, t in enumerate(tasks):
            recs = [r for c in t for r in train[c]]
            self.train[ti] = (self._encode(tok, recs, cfg.max_length),
                              torch.tensor([label[r["package"]] for r in recs]))

    @staticmethod
    def _encode(tok, recs, max_length):
        enc = tok([r["text"] for r in recs], truncation=True, max_length=max_length, padding="max_length",
                  return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _rows(batch: dict, idx: torch.Tensor) -> dict:
    return {k: v[idx] for k, v in batch.items()}


class _Model:
    """The classifier, its feature hook (the head's input) and one LoRA adapter per module."""

    def __init__(self, cfg: ContinualConfig, num_labels: int):
        from rankwise.recipes.model import load_model
        self.cfg = cfg
        self.model, self.tok = load_model(cfg.model, "classification", num_labels, seed=cfg.seed)
        self.model.eval()  # no dropout: deterministic features for matching and CTIRD
        self.head = self._head()
        self.feature = None
        self.head.register_forward_pre_hook(lambda _m, args: setattr(self, "feature", args[0]))
        self.modules: list[str] = []

    def _head(self) -> torch.nn.Module:
        head = getattr(self.model, "classifier", None) or getattr(self.model, "score", None)
        while head is not None and not isinstance(head, torch.nn.Linear):  # RoBERTa-style heads
            head = getattr(head, "out_proj", None)
        if head is None:
            raise RankwiseError(f"model {self.cfg.model!r} has no linear classification head "
                                "(classifier / score); use a sequence-classification model")
        return head

    def add(self, name: str) -> list[torch.nn.Parameter]:
        from rankwise import registry
        from rankwise.core.ops import adapter_parameters, set_adapter
        torch.manual_seed(self.cfg.seed + len(self.modules))
        lora = registry.get("method", "lora")  # recipes reach a method through the registry
        lora.apply(self.model, lora.config_cls(r=self.cfg.r, alpha=2.0 * self.cfg.r), adapter_name=name)
        self.modules.append(name)
        set_adapter(self.model, name)
        self.head.requires_grad_(True)
        params = list(adapter_parameters(self.model, name).values()) + list(self.head.parameters())
        return list({id(p): p for p in params}.values())  # the head may be saved with the adapter

    def forward(self, batch: dict, module: str | None) -> torch.Tensor:
        """Logits with ``module`` active (``None``: the frozen base); sets ``self.feature``."""
        from rankwise.core.ops import disable_adapters, set_adapter
        if module is None:
            if self.modules:
                with disable_adapters(self.model):
                    return self.model(**batch).logits
            return self.model(**batch).logits
        set_adapter(self.model, module)
        return self.model(**batch).logits

    @torch.no_grad()
    def features(self, batch: dict, module: str | None, chunk: int = 64) -> torch.Tensor:
        out = []
        for i in range(0, len(batch["input_ids"]), chunk):
            self.forward(_rows(batch, torch.arange(i, min(i + chunk, len(batch["input_ids"])))), module)
            out.append(self.feature.float())
        return torch.cat(out)


def _masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits with every class outside ``allowed`` (a class mask) set to -inf."""
    return logits.masked_fill(~allowed, float("-inf"))


class _EvalCache:
    """Evaluation logits per (module, example), computed once per evaluation point."""

    def __init__(self, net: _Model, batch: dict, chunk: int = 64):
        self.net, self.batch, self.chunk, self.rows = net, batch, chunk, {}

    @torch.no_grad()
    def logits(self, modules: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = [None] * len(ids)
        for m in modules.unique().tolist():
            have = self.rows.setdefault(m, {})
            todo = sorted({int(i) for i, mm in zip(ids, modules) if int(mm) == m and int(i) not in have})
            for s in range(0, len(todo), self.chunk):
                part = torch.tensor(todo[s:s + self.chunk])
                for i, row in zip(part.tolist(), self.net.forward(_rows(self.batch, part), f"task{m}")):
                    have[i] = row.float()
            for k, (i, mm) in enumerate(zip(ids.tolist(), modules.tolist())):
                if mm == m:
                    out[k] = have[i]
        return torch.stack(out)


def hybrid_rematch(cfg: ContinualConfig, get, matched: torch.Tensor, class_task: torch.Tensor,
                   allowed: torch.Tensor, multi: bool) -> dict[str, torch.Tensor]:
    """Predictions of every inference rule from the matched modules.

    Args:
        get: ``get(modules, rows) -> logits`` of the given rows under the given modules.
        matched: Initially matched module per example.
        class_task: Task of each class.
        allowed: Mask of the classes seen so far.
        multi: More than one task seen (the code re-matches by confidence only then).

    Returns:
        ``{"match", "direct", "hrm"}`` -> predicted class per example.
    """
    rows = torch.arange(len(matched))
    first = _masked(get(matched, rows), allowed)
    direct_mod, switched = direct_rematch(matched, first, class_task)
    second = first.clone()
    if switched.any():
        second[switched] = _masked(get(direct_mod[switched], rows[switched]), allowed)
    hrm = second.clone()
    unsure = low_confidence(first, cfg.tau) if multi else torch.zeros_like(switched)
    if unsure.any():
        k = min(cfg.candidates, int(allowed.sum()))
        cands = candidate_tasks(first[unsure], class_task, k)        # (u, k)
        options = [second[unsure]] + [_masked(get(cands[:, j], rows[unsure]), allowed) for j in range(k)]
        stack = torch.stack(options, dim=1)                           # (u, 1 + k, C)
        best = confidence(stack, cfg.temperature).argmax(-1)
        hrm[unsure] = stack[torch.arange(len(best)), best]
    return {"match": first.argmax(-1), "direct": second.argmax(-1), "hrm": hrm.argmax(-1)}


def _per_task(pred: torch.Tensor, y: torch.Tensor, task_of: torch.Tensor, seen: int) -> list[float]:
    return [float((pred[task_of == j] == y[task_of == j]).float().mean()) for j in range(seen)]


def summary(matrix: list[list[float]]) -> dict[str, float]:
    """Average accuracy after the last task and forgetting from ``matrix[t][j]`` (accuracy on
    task ``j`` after training task ``t``, ``j <= t``): ``F = mean_{j<T-1} (max_{j<=t<T-1}
    a_tj - a_{T-1,j})``."""
    last = matrix[-1]
    T = len(matrix)
    forget = [max(matrix[t][j] for t in range(j, T - 1)) - last[j] for j in range(T - 1)]
    return {"average_accuracy": sum(last) / len(last),
            "forgetting": sum(forget) / len(forget) if forget else 0.0}


def run_continual(cfg: ContinualConfig, tasks: list[list[str]], console=None) -> dict:
    """Train the tasks in order with ``cfg.method`` and evaluate after each.

    Returns:
        ``{"config", "tasks", "rules": {rule: {"matrix", "average_accuracy", "forgetting"}},
        "rematch": {...}}``; ``sequential``/``joint`` have the single rule ``single``.
    """
    cfg.check()
    from rankwise.data.demo import PACKAGES
    parse_tasks(["/".join(",".join(t) for t in tasks)], PACKAGES)
    torch.manual_seed(cfg.seed)
    classes = [c for t in tasks for c in t]
    net = _Model(cfg, len(classes))
    data = _Data(cfg, tasks, net.tok)
    T = len(tasks)
    gen = torch.Generator().manual_seed(cfg.seed)
    eval_task = data.class_task[data.eval_y]
    say = (lambda s: console.print(s)) if console is not None else (lambda s: None)
    per_module = cfg.method in ("hrm-pet", "key-match")
    eval_feats = net.features(data.eval_ids, None) if per_module else None
    key_feats = [net.features(_rows(data.train[t][0], torch.arange(min(cfg.key_examples, len(data.train[t][1])))),
                              None) for t in range(T)] if per_module else None
    matrices = {r: [] for r in (RULES if per_module else ("single",))}
    counts = {"switched": [], "unsure": []}
    head_after = []  # head rows after each task: earlier tasks' rows must not move (masked logits)

    def train_on(batch_of, steps, allowed, params, teachers):
        head = {id(p) for p in net.head.parameters()}
        opt = torch.optim.AdamW([{"params": [p for p in params if id(p) not in head], "lr": cfg.lr},
                                 {"params": [p for p in params if id(p) in head], "lr": cfg.head_lr}],
                                weight_decay=0.0)
        for _ in range(steps):
            batch, y = batch_of()
            losses = {}
            old = []
            for m in teachers:
                with torch.no_grad():
                    net.forward(batch, m)
                    old.append(net.feature.detach())
            logits = net.forward(batch, current)
            loss = torch.nn.functional.cross_entropy(_masked(logits, allowed), y)
            for f in old:
                loss = loss + cfg.distill_weight * relation_distillation(net.feature, f)
            losses["loss"] = float(loss.detach())
            opt.zero_grad()
            loss.backward()
            opt.step()
        return losses

    def sampler(pools):
        ids = torch.cat([p[1] for p in pools]) if len(pools) > 1 else pools[0][1]
        enc = {k: torch.cat([p[0][k] for p in pools]) for k in pools[0][0]}
        state = {"perm": torch.empty(0, dtype=torch.long), "pos": 0}

        def next_batch():
            if state["pos"] + cfg.batch_size > len(state["perm"]):
                state["perm"], state["pos"] = torch.randperm(len(ids), generator=gen), 0
            idx = state["perm"][state["pos"]:state["pos"] + cfg.batch_size]
            state["pos"] += cfg.batch_size
            return _rows(enc, idx), ids[idx]
        return next_batch

    if cfg.method == "joint":
        current = "joint"
        params = net.add(current)
        allowed = torch.ones(len(classes), dtype=torch.bool)
        train_on(sampler([data.train[t] for t in range(T)]), cfg.steps_per_task * T, allowed, params, [])
        logits = torch.cat([net.forward(_rows(data.eval_ids, torch.arange(i, min(i + 64, len(data.eval_y)))), current)
                            for i in range(0, len(data.eval_y), 64)]).detach()
        matrices["single"] = [_per_task(logits.argmax(-1), data.eval_y, eval_task, T)]
        out = {"single": {"matrix": matrices["single"], "average_accuracy": sum(matrices["single"][0]) / T,
                          "forgetting": None}}
        return {"config": asdict(cfg), "tasks": tasks, "rules": out}

    for t in range(T):
        allowed_train = data.class_task == t
        seen_classes = data.class_task <= t
        if cfg.method == "sequential":
            current = "seq"
            params = net.add(current) if t == 0 else [p for p in net.model.parameters() if p.requires_grad]
            teachers = []
        else:
            current = f"task{t}"
            params = net.add(current)
            teachers = ([f"task{j}" for j in range(t - 1, -1, -1)][:cfg.distill_modules]
                        if cfg.method == "hrm-pet" and cfg.distill_weight > 0 else [])
        train_on(sampler([data.train[t]]), cfg.steps_per_task, allowed_train, params, teachers)
        head_after.append(torch.cat([net.head.weight, net.head.bias[:, None]], 1).detach().clone())
        mask = eval_task <= t
        rows_y, rows_task = data.eval_y[mask], eval_task[mask]
        batch = _rows(data.eval_ids, mask.nonzero().flatten())
        if cfg.method == "sequential":
            with torch.no_grad():
                logits = torch.cat([net.forward(_rows(batch, torch.arange(i, min(i + 64, len(rows_y)))), current)
                                    for i in range(0, len(rows_y), 64)])
            pred = _masked(logits, seen_classes).argmax(-1)
            matrices["single"].append(_per_task(pred, rows_y, rows_task, t + 1))
            continue
        keys = task_keys(torch.cat(key_feats[:t + 1]),
                         torch.cat([torch.full((len(f),), j) for j, f in enumerate(key_feats[:t + 1])]), t + 1)
        matched = match_keys(eval_feats[mask], keys)
        cache = _EvalCache(net, batch)
        preds = hybrid_rematch(cfg, cache.logits, matched, data.class_task, seen_classes, multi=t > 0)
        preds["oracle"] = _masked(cache.logits(rows_task, torch.arange(len(rows_y))), seen_classes).argmax(-1)
        for rule in RULES:
            matrices[rule].append(_per_task(preds[rule], rows_y, rows_task, t + 1))
        first = _masked(cache.logits(matched, torch.arange(len(rows_y))), seen_classes)
        counts["switched"].append(int(direct_rematch(matched, first, data.class_task)[1].sum()))
        counts["unsure"].append(int(low_confidence(first, cfg.tau).sum()) if t > 0 else 0)
        counts.setdefault("match_task_accuracy", []).append(float((matched == rows_task).float().mean()))
        say(f"task {t + 1}/{T}: " + "  ".join(f"{r} {sum(matrices[r][-1]) / (t + 1):.3f}" for r in RULES))
    out = {r: {"matrix": m, **summary(m)} for r, m in matrices.items()}
    drift = max(float((head_after[-1][data.class_task == j] - head_after[j][data.class_task == j]).abs().max())
                for j in range(T))
    return {"config": asdict(cfg), "tasks": tasks, "rules": out, "rematch": counts if per_module else None,
            "head_drift": drift}


def continual_command(config: Path, tasks: str, method: str | None, out: Path | None) -> dict:
    """``rankwise continual``: check the tasks before loading anything, run, print, write."""
    import json

    from rich.console import Console

    from rankwise.core import atomic
    from rankwise.data.demo import PACKAGES
    parsed = parse_tasks(tasks, PACKAGES)
    cfg = load_config(config, {"method": method} if method else None)
    console = Console()
    record = run_continual(cfg, parsed, console)
    for rule, r in record["rules"].items():
        f = r["forgetting"]
        console.print(f"{cfg.method} ({rule}): average accuracy {r['average_accuracy']:.3f}"
                      + (f", forgetting {f:.3f}" if f is not None else ""))
    if out is not None:
        atomic.write_json(out, record)
        console.print(f"wrote {out}")
    return json.loads(json.dumps(record))
