"""``rankwise continual CONFIG --tasks ...``: continual learning with one LoRA module per task
(HRM-PET, Wei et al. 2025; the maths: :mod:`rankwise.commands.continual.maths`; docs/continual.md).

The packaged MiniLM classifier of the demo task (:mod:`rankwise.data.demo`) stays frozen; the
eight standard-library packages are split into tasks (``--tasks asyncio,email/http,importlib``:
tasks separated by ``/``, classes by ``,``) learned one after the other without stored
exemplars. Methods (``continual.method``):

* ``hrm-pet``: a LoRA adapter per task (its classes' rows of the shared head train with it; the
  logits of other classes are masked while a task trains, so earlier rows do not move), trained
  with cross-entropy + ``distill_weight`` x CTIRD against the features of up to
  ``distill_modules`` earlier modules; at inference an initial matcher (the trained
  task-identity classifier, ``tii``, the authors' code; or task keys, ``keys``), then the
  hybrid re-matching;
* ``key-match``: the same per-task modules without CTIRD (its ``keys:match`` rule is the
  L2P/CODA-style key-matching baseline);
* ``sequential``: one adapter trained task after task (the forgetting baseline);
* ``joint``: one adapter trained on all tasks at once (the upper bound).

Evaluation is class-incremental: after each task, the evaluation examples of every task seen so
far, scored over the classes seen so far. Per-task-module methods report every inference rule
``<matcher>:<rule>`` on the same modules (:mod:`rankwise.commands.continual.rules`): matchers
``tii`` and ``keys``; rules ``match``, ``direct`` re-matching only, ``hrm`` = direct +
confidence-based at ``tau``, ``hrm-tuned`` = the same with ``tau`` chosen on a validation split
held out of the training records; and ``oracle`` = the true task's module (task-incremental).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from rankwise import configs
from rankwise.commands.continual.maths import GATES, TaskIdentity, relation_distillation
from rankwise.errors import RankwiseError
from rankwise.commands.continual.rules import (MATCHERS, STEPS, EvalCache, masked, matchers, rows_of,
                                              score_point)
from rankwise.commands.continual.rules import hybrid_rematch  # noqa: F401  (re-exported)

METHODS = ("hrm-pet", "key-match", "sequential", "joint")
RULES = tuple(f"{m}:{r}" for m in MATCHERS for r in STEPS) + ("oracle",)
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
        matcher: Initial matcher of the method's own rule: ``tii`` (the trained task-identity
            classifier, the authors' code) or ``keys``; both are always scored.
        tii_steps, tii_lr: Full-batch AdamW steps and rate of the task-identity classifier on
            each task's frozen features.
        tii_align_steps, tii_samples: Classifier-alignment steps after each task but the first,
            each on ``tii_samples`` draws per seen class of its feature Gaussian.
        gate: Confidence rule of the re-matching: ``gen`` (the code's default, negated
            generalised entropy) or ``msp`` (max softmax probability).
        tau: Confidence-based re-matching runs on examples whose gate score is below ``tau``
            (code: ``--tau -10`` with ``gen``; ``msp`` needs a probability).
        val_per_class: Training records per class held out as the validation split on which
            ``hrm-tuned`` picks ``tau`` (0: no tuning).
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
    matcher: str = "tii"
    tii_steps: int = 100
    tii_lr: float = 1e-2
    tii_align_steps: int = 30
    tii_samples: int = 16
    gate: str = "gen"
    tau: float = -10.0
    val_per_class: int = 15
    temperature: float = 0.1
    candidates: int = 2
    distill_weight: float = 0.1
    distill_modules: int = 5
    seed: int = 0

    def problems(self) -> list[str]:
        """Every bad setting, each ``"<key> ..."`` (:func:`rankwise.configs.from_dict` puts
        ``continual.`` before it)."""
        bad = []
        if self.method not in METHODS:
            bad.append(f"method {self.method!r}: expected one of {list(METHODS)}")
        if self.matcher not in MATCHERS:
            bad.append(f"matcher {self.matcher!r}: expected one of {list(MATCHERS)}")
        if self.gate not in GATES:
            bad.append(f"gate {self.gate!r}: expected one of {list(GATES)}")
        elif self.gate == "msp" and not 0 < self.tau <= 1:
            bad.append(f"tau {self.tau} with gate msp: give a probability in (0, 1] (e.g. 0.8)")
        for name in ("steps_per_task", "batch_size", "r", "max_length", "eval_per_class",
                     "key_examples", "candidates", "tii_samples"):
            if getattr(self, name) < 1:
                bad.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("tii_steps", "tii_align_steps", "val_per_class"):
            if getattr(self, name) < 0:
                bad.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.eval_fraction < 1:
            bad.append(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        return bad



def load_config(path: Path | None, sets: list[str] | tuple[str, ...] = (),
                overrides: dict | None = None) -> ContinualConfig:
    """``ContinualConfig`` from a YAML file (keys at top level or under ``continual:``), read as
    every config is (:func:`rankwise.commands.options.read_config`: YAML 1.2 numbers, so
    ``lr: 1e-3`` is a number; ``--set KEY=VALUE`` or ``continual.KEY=VALUE``; every unknown key
    and bad value in one line), then ``overrides`` (``--method``).

    Raises:
        RankwiseError: A missing file, an unknown key or a bad value, all at once.
    """
    from rankwise.configs import from_dict, to_dict
    if path is None:
        cfg = from_dict(ContinualConfig, dict(overrides or {}), "continual")
    else:
        from rankwise.commands.options import read_config
        cfg = read_config(ContinualConfig, Path(path), sets, "continual", section="continual")
        if overrides:
            cfg = from_dict(ContinualConfig, {**to_dict(cfg), **overrides}, "continual")
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
    """Tokenized demo records of the tasks' classes: training pools, the validation split (the
    last ``val_per_class`` training records of each class, held out) and the evaluation set."""

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
        # validation split: the last val_per_class training records of each class (never trained on)
        cut = {c: max(1, len(train[c]) - cfg.val_per_class) for c in self.classes}
        val = [r for c in self.classes for r in train[c][cut[c]:]] if cfg.val_per_class else []
        self.val_ids = self._encode(tok, val, cfg.max_length) if val else None
        self.val_y = torch.tensor([label[r["package"]] for r in val], dtype=torch.long)
        self.train = {}
        for ti, t in enumerate(tasks):
            recs = [r for c in t for r in (train[c][:cut[c]] if cfg.val_per_class else train[c])]
            self.train[ti] = (self._encode(tok, recs, cfg.max_length),
                              torch.tensor([label[r["package"]] for r in recs]))

    @staticmethod
    def _encode(tok, recs, max_length):
        enc = tok([r["text"] for r in recs], truncation=True, max_length=max_length, padding="max_length",
                  return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


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
            self.forward(rows_of(batch, torch.arange(i, min(i + chunk, len(batch["input_ids"])))), module)
            out.append(self.feature.float())
        return torch.cat(out)


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


def _train_on(cfg: ContinualConfig, net: _Model, batch_of, steps: int, allowed: torch.Tensor,
              params: list, teachers: list[str], current: str) -> dict:
    """``steps`` AdamW steps of module ``current`` (CE over ``allowed`` + CTIRD to ``teachers``)."""
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
        loss = torch.nn.functional.cross_entropy(masked(logits, allowed), y)
        for f in old:
            loss = loss + cfg.distill_weight * relation_distillation(net.feature, f)
        losses["loss"] = float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def _sampler(cfg: ContinualConfig, gen: torch.Generator, pools: list):
    """A function giving the next shuffled batch of ``pools`` (a new permutation per epoch)."""
    ids = torch.cat([p[1] for p in pools]) if len(pools) > 1 else pools[0][1]
    enc = {k: torch.cat([p[0][k] for p in pools]) for k in pools[0][0]}
    state = {"perm": torch.empty(0, dtype=torch.long), "pos": 0}

    def next_batch():
        if state["pos"] + cfg.batch_size > len(state["perm"]):
            state["perm"], state["pos"] = torch.randperm(len(ids), generator=gen), 0
        idx = state["perm"][state["pos"]:state["pos"] + cfg.batch_size]
        state["pos"] += cfg.batch_size
        return rows_of(enc, idx), ids[idx]
    return next_batch


def _module_features(cfg: ContinualConfig, net: _Model, data: _Data, T: int, n_classes: int):
    """The frozen features and the task-identity classifier of the per-task-module methods."""
    eval_feats = net.features(data.eval_ids, None)
    val_feats = net.features(data.val_ids, None) if data.val_ids is not None else None
    train_feats = [net.features(data.train[t][0], None) for t in range(T)]
    return SimpleNamespace(eval=eval_feats, val=val_feats, train=train_feats,
                           keys=[f[:cfg.key_examples] for f in train_feats],
                           tii=TaskIdentity(eval_feats.shape[1], n_classes, cfg.seed),
                           val_task=data.class_task[data.val_y])


def _run_joint(cfg: ContinualConfig, net: _Model, data: _Data, tasks: list[list[str]],
               gen: torch.Generator, eval_task: torch.Tensor) -> dict:
    """``joint``: one adapter on every task at once, evaluated once."""
    T, n_classes = len(tasks), len(data.class_task)
    current = "joint"
    params = net.add(current)
    allowed = torch.ones(n_classes, dtype=torch.bool)
    _train_on(cfg, net, _sampler(cfg, gen, [data.train[t] for t in range(T)]), cfg.steps_per_task * T,
              allowed, params, [], current)
    logits = torch.cat([net.forward(rows_of(data.eval_ids, torch.arange(i, min(i + 64, len(data.eval_y)))), current)
                        for i in range(0, len(data.eval_y), 64)]).detach()
    single = [_per_task(logits.argmax(-1), data.eval_y, eval_task, T)]
    out = {"single": {"matrix": single, "average_accuracy": sum(single[0]) / T, "forgetting": None}}
    return {"config": asdict(cfg), "tasks": tasks, "rules": out}


def _task_module(cfg: ContinualConfig, net: _Model, t: int) -> tuple[str, list, list[str]]:
    """Task ``t``'s module name, the parameters it trains, and its CTIRD teachers."""
    if cfg.method == "sequential":
        current = "seq"
        params = net.add(current) if t == 0 else [p for p in net.model.parameters() if p.requires_grad]
        return current, params, []
    current = f"task{t}"
    params = net.add(current)
    teachers = ([f"task{j}" for j in range(t - 1, -1, -1)][:cfg.distill_modules]
                if cfg.method == "hrm-pet" and cfg.distill_weight > 0 else [])
    return current, params, teachers


def _score_modules(cfg: ContinualConfig, t: int, net: _Model, data: _Data, feats, mask: torch.Tensor,
                   batch: dict, rows_y: torch.Tensor, rows_task: torch.Tensor,
                   matrices: dict, counts: dict) -> None:
    """After task ``t``: train the matchers, score every rule, append to ``matrices``/``counts``."""
    allowed_train, seen_classes = data.class_task == t, data.class_task <= t
    feats.tii.learn_task(feats.train[t], data.train[t][1], allowed_train, cfg.tii_steps, cfg.tii_lr)
    if t > 0:
        feats.tii.align(seen_classes, cfg.tii_align_steps, cfg.tii_lr, cfg.tii_samples)
    vmask = feats.val_task <= t
    m_eval = matchers(t, feats.keys, feats.tii, feats.eval[mask], data.class_task, seen_classes)
    m_val = (matchers(t, feats.keys, feats.tii, feats.val[vmask], data.class_task, seen_classes)
             if feats.val is not None else {m: torch.zeros(0, dtype=torch.long) for m in MATCHERS})
    cache = EvalCache(net, batch)
    vcache = EvalCache(net, rows_of(data.val_ids, vmask.nonzero().flatten())) if feats.val is not None else None
    preds, point = score_point(cfg, t, m_eval, m_val, cache, vcache, rows_y,
                               data.val_y[vmask], data.class_task, seen_classes)
    preds["oracle"] = masked(cache.logits(rows_task, torch.arange(len(rows_y))), seen_classes).argmax(-1)
    for rule in RULES:
        matrices[rule].append(_per_task(preds[rule], rows_y, rows_task, t + 1))
    for m in MATCHERS:
        point[m]["match_task_accuracy"] = float((m_eval[m] == rows_task).float().mean())
        for k, v in point[m].items():
            counts[m].setdefault(k, []).append(v)


def run_continual(cfg: ContinualConfig, tasks: list[list[str]], console=None) -> dict:
    """Train the tasks in order with ``cfg.method`` and evaluate after each.

    Returns:
        ``{"config", "tasks", "rules": {rule: {"matrix", "average_accuracy", "forgetting"}},
        "rematch": {matcher: {counter: one value per task}}, "primary", "head_drift"}``;
        ``primary`` is the method's own rule (``<matcher>:hrm``); ``sequential``/``joint`` have
        the single rule ``single``.
    """
    if bad := configs.problems_of(cfg):  # a config built in code (files are checked when read)
        raise RankwiseError("; ".join(f"continual.{p}" for p in bad))
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
    feats = _module_features(cfg, net, data, T, len(classes)) if per_module else None
    matrices = {r: [] for r in (RULES if per_module else ("single",))}
    counts = {m: {} for m in MATCHERS}
    head_after = []  # head rows after each task: earlier tasks' rows must not move (masked logits)
    if cfg.method == "joint":
        return _run_joint(cfg, net, data, tasks, gen, eval_task)
    for t in range(T):
        current, params, teachers = _task_module(cfg, net, t)
        _train_on(cfg, net, _sampler(cfg, gen, [data.train[t]]), cfg.steps_per_task, data.class_task == t,
                  params, teachers, current)
        head_after.append(torch.cat([net.head.weight, net.head.bias[:, None]], 1).detach().clone())
        mask = eval_task <= t
        rows_y, rows_task = data.eval_y[mask], eval_task[mask]
        batch = rows_of(data.eval_ids, mask.nonzero().flatten())
        if cfg.method == "sequential":
            with torch.no_grad():
                logits = torch.cat([net.forward(rows_of(batch, torch.arange(i, min(i + 64, len(rows_y)))), current)
                                    for i in range(0, len(rows_y), 64)])
            pred = masked(logits, data.class_task <= t).argmax(-1)
            matrices["single"].append(_per_task(pred, rows_y, rows_task, t + 1))
            continue
        _score_modules(cfg, t, net, data, feats, mask, batch, rows_y, rows_task, matrices, counts)
        say(f"task {t + 1}/{T}: " + "  ".join(f"{r} {sum(matrices[r][-1]) / (t + 1):.3f}" for r in RULES))
    out = {r: {"matrix": m, **summary(m)} for r, m in matrices.items()}
    drift = max(float((head_after[-1][data.class_task == j] - head_after[j][data.class_task == j]).abs().max())
                for j in range(T))
    return {"config": asdict(cfg), "tasks": tasks, "rules": out, "rematch": counts if per_module else None,
            "primary": f"{cfg.matcher}:hrm" if per_module else "single", "head_drift": drift}


def continual_command(config: Path, tasks: str, method: str | None, out: Path | None,
                      sets: list[str] | tuple[str, ...] = ()) -> dict:
    """``rankwise continual``: check the tasks before loading anything, run, print, write."""
    import json

    from rich.console import Console

    from rankwise.core import atomic
    from rankwise.data.demo import PACKAGES
    parsed = parse_tasks(tasks, PACKAGES)
    cfg = load_config(config, sets, {"method": method} if method else None)
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
