"""``rankwise bench lowrank-pretrain``: pre-train a tiny Llama on the Python standard library's
source with every low-rank optimizer and the peer ``galore-torch``, in one process.

Data: every ``.py`` file of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), tests, ``idlelib`` and ``site-packages`` left out. Each
module goes to the held-out split when ``crc32(module name) % 10 == 0`` (deterministic on every
machine with the same Python version), otherwise to training. Tokenizer: raw UTF-8 **bytes**
(vocabulary 256, no merges), so perplexity is per byte.

Every optimizer sees the same initial weights, the same batches in the same order and the same
schedule (10% linear warm-up, cosine to 10%), over a small learning-rate grid of its own; the
best learning rate by held-out loss is reported. Runs are interleaved (all methods at the first
learning rate, then the second...) so that load from other processes spreads over all methods
and step-time ratios to AdamW are measured under the same conditions. Steps run through the
shared :class:`rankwise.engine.Engine` with the ``causal-lm`` task.

A row (:class:`Row`) is data: a registered optimizer plus config overrides; its learning-rate
grid and state formula are the registry entry's ``lr_grid`` and ``state_floats``.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import math
import platform
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Union

import torch
from torch import nn

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.engine import Engine, NonFiniteLoss, evaluate, get_task
from rankwise.errors import RankwiseError
from rankwise.optim.common import split_params, state_bytes

SIZED_FIELDS = ("rank", "update_every", "eps")  # set from Sizes on every config that has them


@dataclass(frozen=True)
class Row:
    """One row of the benchmark: a registered optimizer and what this row changes about it.

    Attributes:
        optimizer: Registry name. Its config, ``lr_grid`` and ``state_floats`` describe the row.
        overrides: Config fields set on top of the sizes.
        keep: Config fields left at the optimizer's default although :data:`SIZED_FIELDS` names them.
        lrs: Learning rates instead of the entry's ``lr_grid``; a registry name borrows that
            entry's grid.
        build: ``build(model, config) -> optimizer`` for a row that is not the registered
            optimizer itself (the peer, a control); ``None`` uses the registry's builder.
        truncate: Also report the held-out loss after truncating every block matrix to rank ``r``.
        requires: A module the row imports (a peer's package); the row is skipped without it.
    """

    optimizer: str
    overrides: dict = field(default_factory=dict)
    keep: tuple[str, ...] = ()
    lrs: Union[tuple[float, ...], str] = ()
    build: Callable[[nn.Module, Any], torch.optim.Optimizer] | None = None
    truncate: bool = False
    requires: str | None = None

    def config(self, lr: float, s: Sizes) -> Any:
        """The optimizer config at ``lr`` (NGN-M: its ``c``), with the sizes' ``rank``,
        ``update_every`` and ``eps`` on every config that has those fields."""
        cls = registry.get("optimizer", self.optimizer).config_cls
        names = {f.name for f in fields(cls)}
        sized = {k: getattr(s, k) for k in SIZED_FIELDS if k in names and k not in self.keep}
        return from_dict(cls, {**sized, **self.overrides, "name": self.optimizer, "lr": lr}, "optim")

    def grid(self, s: Sizes) -> tuple[float, ...]:
        """Learning rates: ``s.lrs``, else the row's own, else the entry's ``lr_grid``."""
        if s.lrs:
            return tuple(s.lrs)
        if isinstance(self.lrs, str):
            return registry.get("optimizer", self.lrs).lr_grid
        return tuple(self.lrs) or registry.get("optimizer", self.optimizer).lr_grid

    def make(self, model: nn.Module, config: Any) -> torch.optim.Optimizer:
        """The optimizer over ``model`` (the row's builder, else the registry's)."""
        return (self.build or registry.get("optimizer", self.optimizer).builder)(model, config)

    def formula_bytes(self, model: nn.Module, config: Any) -> int | None:
        """fp32 state bytes the entry's ``state_floats`` predicts for ``model`` (or ``None``)."""
        floats = registry.get("optimizer", self.optimizer).state_floats
        return None if floats is None else 4 * floats(model, config)


def _galore_torch(model: nn.Module, config: Any) -> torch.optim.Optimizer:
    """The peer ``galore_torch.GaLoreAdamW`` with the param groups and settings of ``config``."""
    import galore_torch
    proj, plain = split_params(model, config.targets)
    groups = [{"params": [p for _, p in plain]},
              {"params": [p for _, p in proj], "rank": config.rank, "update_proj_gap": config.update_every,
               "scale": config.scale, "proj_type": "std"}]
    return galore_torch.GaLoreAdamW(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                                    weight_decay=config.weight_decay, no_deprecation_warning=True)


def _adamw_split(model: nn.Module, config: Any) -> torch.optim.Optimizer:
    """The control: full AdamW with GaLore's per-group learning rates (block matrices at
    ``lr * alpha``, GaLore's default scale; the rest at ``lr``)."""
    alpha = registry.get("optimizer", "galore").config_cls().scale
    proj, plain = split_params(model)
    return torch.optim.AdamW([{"params": [p for _, p in plain]},
                              {"params": [p for _, p in proj], "lr": config.lr * alpha}],
                             lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                             weight_decay=config.weight_decay)


ROWS: dict[str, Row] = {
    "adamw": Row("adamw", truncate=True),
    "adamw-split": Row("adamw", lrs="galore", build=_adamw_split),
    "galore-torch": Row("galore", build=_galore_torch, requires="galore_torch"),
    "galore": Row("galore"),
    # rankwise's galore with its two step-time options on: Gram eigh instead of the SVD, and
    # refreshes staggered over the period.
    "galore-eigh": Row("galore", {"svd": "eigh", "stagger": True}),
    "galore-is": Row("galore-is"),
    "sumo": Row("sumo"),
    # Q3R's update_every is its reweighting period, not a subspace refresh: its own default.
    "q3r": Row("q3r", keep=("update_every",), truncate=True),
    "ngn-m": Row("ngn-m"),
}
METHODS = tuple(ROWS)


@dataclass
class Sizes:
    """Everything that sets the benchmark's size (chosen to fit ~10 min on 2 shared CPU cores).

    Attributes:
        hidden, layers, heads, intermediate: The Llama shape.
        seq: Bytes per training window.
        batch: Windows per step.
        steps: Optimizer steps per run.
        eval_windows: Held-out windows for the final loss.
        rank: ``rank`` of every optimizer config that has one (subspace rank of projected
            matrices, Q3R's target rank).
        update_every: ``update_every`` of every config that has one (subspace refresh period),
            unless a row keeps its own.
        eps: Adam's epsilon of every config that has one.
        lrs: One learning-rate grid for every row instead of each row's own (tests).
        threads: torch intra-op threads.
        seed: Seed of the initial weights, of the windows and of the batch order.
    """

    hidden: int = 128
    layers: int = 2
    heads: int = 4
    intermediate: int = 256
    seq: int = 64
    batch: int = 8
    steps: int = 120
    eval_windows: int = 64
    rank: int = 32
    update_every: int = 30
    eps: float = 1e-6
    lrs: tuple[float, ...] = ()
    threads: int = 1
    seed: int = 0


class ByteWindows:
    """Causal-LM examples: windows of ``seq`` bytes of ``data`` starting at ``starts``.

    Args:
        data: The corpus as a uint8 tensor.
        starts: Start offset of each window, shape ``(N,)``.
        seq: Window length.
    """

    pad_id = 0  # every window is full, so nothing is padded

    def __init__(self, data: torch.Tensor, starts: torch.Tensor, seq: int) -> None:
        self.data, self.starts, self.seq = data, starts.flatten(), seq

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        """Window ``i`` as ``{"input_ids": [byte, ...]}``."""
        start = int(self.starts[i])
        return {"input_ids": self.data[start: start + self.seq].tolist()}


def load_corpus() -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Read the standard library's source as bytes, split by module name.

    Returns:
        ``(train, heldout, info)``: uint8 tensors of concatenated files (separated by a blank
        line) and a dict with file and byte counts.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
    parts: dict[str, list[bytes]] = {"train": [], "heldout": []}
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if skip & set(rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts)
        split = "heldout" if zlib.crc32(module.encode()) % 10 == 0 else "train"
        parts[split].append(f.read_bytes() + b"\n\n")
    info = {"stdlib": str(root), "files": {k: len(v) for k, v in parts.items()}}
    data = {k: torch.frombuffer(bytearray(b"".join(v)), dtype=torch.uint8) for k, v in parts.items()}
    info["bytes"] = {k: int(v.numel()) for k, v in data.items()}
    return data["train"], data["heldout"], info


def build_model(s: Sizes) -> nn.Module:
    """A Llama-style causal LM built from ``LlamaConfig`` with seeded random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(s.seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_hidden_layers=s.layers, num_attention_heads=s.heads,
                      num_key_value_heads=s.heads, max_position_embeddings=s.seq,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def counted_state_bytes(opt: torch.optim.Optimizer) -> int:
    """State bytes from the tensors in ``opt.state`` (plus galore-torch's projector object)."""
    total = state_bytes(opt)
    for st in opt.state.values():
        proj = st.get("projector")
        if proj is not None and torch.is_tensor(getattr(proj, "ortho_matrix", None)):
            total += proj.ortho_matrix.numel() * proj.ortho_matrix.element_size()
    return total


def heldout_loss(model: nn.Module, heldout: ByteWindows) -> float:
    """Mean next-byte cross-entropy (nats) over the held-out windows (the task's ``eval_loss``)."""
    return evaluate(model, get_task("causal-lm"), heldout, 16)["eval_loss"]


def _engine(name: str, lr: float, s: Sizes, train: ByteWindows) -> tuple[Engine, Any]:
    """A fresh model, the row's optimizer and schedule, in an :class:`Engine`; and the config."""
    model = build_model(s)
    config = ROWS[name].config(lr, s)
    opt = ROWS[name].make(model, config)
    warm = max(1, s.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / warm if k < warm else
                                              0.1 + 0.45 * (1 + math.cos(math.pi * (k - warm) / (s.steps - warm))))
    return Engine(model, get_task("causal-lm"), opt, train, s.batch, seed=s.seed, scheduler=sched), config


def _record_step_times(opt: torch.optim.Optimizer) -> list[float]:
    """Seconds of every ``opt.step`` call from now on, measured by the optimizer's step hooks."""
    times: list[float] = []
    began: list[float] = []
    opt.register_step_pre_hook(lambda *_: began.append(time.perf_counter()))
    opt.register_step_post_hook(lambda *_: times.append(time.perf_counter() - began.pop()))
    return times


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def train_one(name: str, lr: float, s: Sizes, train: ByteWindows, heldout: ByteWindows) -> dict:
    """Train one (row, learning rate) and measure it.

    The harness times whole ``engine.train_step`` calls; ``optimizer.step`` is timed inside them
    by the optimizer's step hooks, and forward+backward is the difference (it also holds the
    step's collation and the engine's finiteness check, the same for every row).

    Returns:
        Curves, held-out loss, state bytes (counted and formula), step times.
    """
    engine, config = _engine(name, lr, s, train)
    model, opt = engine.model, engine.optimizer
    opt_t = _record_step_times(opt)
    curve, step_t, diverged = [], [], False
    for k in range(s.steps):
        t0 = time.perf_counter()
        try:
            curve.append(engine.train_step(k).loss)
        except NonFiniteLoss as err:
            curve.append(float("nan") if err.value is None else err.value)
            diverged = True
            break
        step_t.append(time.perf_counter() - t0)
    out = {"method": name, "lr": lr, "train_curve": curve, "diverged": diverged,
           "heldout_loss": float("nan") if diverged else heldout_loss(model, heldout),
           "state_bytes": counted_state_bytes(opt), "formula_bytes": ROWS[name].formula_bytes(model, config),
           "param_bytes": sum(p.numel() * 4 for p in model.parameters()),
           "step_s": _mean(step_t), "opt_step_s": _mean(opt_t), "max_opt_step_s": max(opt_t, default=0.0),
           "fwd_bwd_median_s": _median([a - b for a, b in zip(step_t, opt_t)])}
    if ROWS[name].truncate and not diverged:
        from rankwise.optim.q3r import truncate_to_factorized
        small = copy.deepcopy(model)
        truncate_to_factorized(small, s.rank)
        out["heldout_loss_truncated"] = heldout_loss(small, heldout)
    return out


def peak_tensor_mib(name: str, lr: float, s: Sizes, train: ByteWindows) -> dict | None:
    """Peak memory of live tensors over two training steps (the first one computes every
    subspace), measured by torch's ``MemTracker`` (it sees every tensor torch allocates,
    unlike the process RSS, which a long-lived process does not give back).

    Returns:
        ``{"total": MiB, "optimizer": MiB}`` or ``None`` if the tracker is unavailable.
    """
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:  # pragma: no cover - private torch tool
        return None
    engine, _ = _engine(name, lr, s, train)
    tracker = MemTracker()
    tracker.track_external(engine.model, engine.optimizer)
    with tracker:
        for k in range(2):
            engine.train_step(k)
            tracker.reset_mod_stats()
    snap = tracker.get_tracker_snapshot("peak")
    cpu = next(iter(snap.values()))
    opt_key = next(k for k in cpu if str(k).endswith("OPT"))
    return {"total": cpu["Total"] / 2**20, "optimizer": cpu[opt_key] / 2**20}


def _table(best: dict, ratios: dict, s: Sizes) -> str:
    lines = ["| optimizer | best lr | held-out loss (nats/byte) | ppl/byte | loss after rank-"
             f"{s.rank} truncation | state MiB counted | state MiB formula | params+grads+state MiB | "
             "peak live tensors MiB (optimizer's) | "
             "step time / AdamW, measured | step time / AdamW, common fwd+bwd | optimizer.step / "
             "AdamW's | slowest optimizer.step ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in best.items():
        trunc = r.get("heldout_loss_truncated")
        lines.append(
            f"| {m} | {r['lr']:g} | {r['heldout_loss']:.4f} | {math.exp(r['heldout_loss']):.3f} | "
            f"{'' if trunc is None else f'{trunc:.4f}'} | {r['state_bytes'] / 2**20:.3f} | "
            f"{_mib(r['formula_bytes'])} | {(2 * r['param_bytes'] + r['state_bytes']) / 2**20:.2f} | "
            f"{_peak(r)} | {ratios[m]['step']:.2f} | "
            f"{ratios[m]['step_common_fb']:.2f} | {ratios[m]['opt_step']:.2f} | "
            f"{ratios[m]['refresh_step_ms']:.0f} |")
    return "\n".join(lines)


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.3f}"


def _peak(r: dict) -> str:
    p = r.get("peak_mib")
    return "n/a" if p is None else f"{p['total']:.2f} ({p['optimizer']:.2f})"


def _plot(best: dict, runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for m, r in best.items():
        c = torch.tensor(r["train_curve"])
        k = 10
        smooth = c.unfold(0, k, 1).mean(1) if len(c) > k else c
        a.plot(range(k - 1, k - 1 + len(smooth)), smooth.tolist(), label=f"{m} (lr {r['lr']:g})")
        pts = sorted((x["lr"], x["heldout_loss"]) for x in runs if x["method"] == m)
        b.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    a.set(xlabel="step", ylabel="train loss (nats/byte, 10-step mean)", title="best learning rate per optimizer")
    b.set(xscale="log", xlabel="learning rate (NGN-M: c)", ylabel="held-out loss", title="learning-rate sweep")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out: Path, sizes: Sizes | None = None, methods: tuple[str, ...] = METHODS) -> dict:
    """Run the benchmark and write ``results.json``, ``results.md`` and ``loss_curves.png``.

    Args:
        out: Output folder (created).
        sizes: Override the default :class:`Sizes` (tests use a tiny one).
        methods: Which rows of :data:`ROWS` to run (``adamw`` is always included: it is the
            time base; a row whose ``requires`` is not installed is left out).

    Returns:
        The results dict written to ``results.json``.

    Raises:
        RankwiseError: If a name in ``methods`` is not a row.
    """
    s = sizes or Sizes()
    unknown = [m for m in methods if m not in ROWS]
    if unknown:
        raise RankwiseError(f"lowrank-pretrain rows: got {unknown}; expected some of {list(ROWS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    t_start = time.time()
    try:
        train, held, info = load_corpus()
        g = torch.Generator().manual_seed(s.seed)
        # steps x batch windows: the engine's batch order visits each once (one epoch).
        starts = torch.randint(0, train.numel() - s.seq, (s.steps, s.batch), generator=g)
        eval_starts = torch.randint(0, held.numel() - s.seq, (s.eval_windows,), generator=g)
        train_windows = ByteWindows(train, starts, s.seq)
        heldout = ByteWindows(held, eval_starts, s.seq)
        methods = tuple(m for m in dict.fromkeys(("adamw",) + tuple(methods))
                        if ROWS[m].requires is None or importlib.util.find_spec(ROWS[m].requires))
        grids = {m: ROWS[m].grid(s) for m in methods}
        runs = []
        for i in range(max(len(grid) for grid in grids.values())):
            for m in methods:
                if i < len(grids[m]):
                    runs.append(train_one(m, grids[m][i], s, train_windows, heldout))
    finally:
        torch.set_num_threads(threads)
    best = {}
    for m in methods:
        ok = [r for r in runs if r["method"] == m and math.isfinite(r["heldout_loss"])]
        best[m] = min(ok, key=lambda r: r["heldout_loss"]) if ok else [r for r in runs if r["method"] == m][0]
        best[m]["peak_mib"] = peak_tensor_mib(m, best[m]["lr"], s, train_windows)

    def mean(m, key):
        vals = [r[key] for r in runs if r["method"] == m and not r["diverged"]]
        return sum(vals) / max(len(vals), 1)
    # Forward+backward is the same work for every method; under a shared machine its time is
    # mostly noise from other processes, so a second ratio uses one common (median) value for it.
    fb = _median([r["fwd_bwd_median_s"] for r in runs if not r["diverged"]])
    ratios = {m: {"step": mean(m, "step_s") / mean("adamw", "step_s"),
                  "step_common_fb": (fb + mean(m, "opt_step_s")) / (fb + mean("adamw", "opt_step_s")),
                  "opt_step": mean(m, "opt_step_s") / mean("adamw", "opt_step_s"),
                  "refresh_step_ms": max(r["max_opt_step_s"] for r in runs if r["method"] == m) * 1e3}
              for m in methods}
    model = build_model(s)
    result = {
        "sizes": asdict(s), "corpus": info, "tokenizer": "bytes (vocab 256)",
        "model_params": sum(p.numel() for p in model.parameters()),
        "python": platform.python_version(), "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} cores visible".strip(),
        "wall_s": time.time() - t_start, "step_time_ratio_to_adamw": ratios,
        "rows": {m: {"optimizer": ROWS[m].optimizer, "overrides": ROWS[m].overrides,
                     "lrs": list(grids[m])} for m in methods},
        "best": {m: {k: v for k, v in r.items() if k != "train_curve"} for m, r in best.items()},
        "runs": runs,
    }
    try:
        import galore_torch  # noqa: F401
        from importlib.metadata import version
        result["peer"] = {"galore-torch": version("galore-torch"), "bitsandbytes": version("bitsandbytes")}
    except Exception:  # pragma: no cover - the peer is a bench-only extra
        result["peer"] = None
    (out / "results.json").write_text(json.dumps(result, indent=1))
    md = [f"# lowrank-pretrain\n",
          f"Llama {s.layers}x{s.hidden} (intermediate {s.intermediate}, {result['model_params']:,} params), "
          f"byte tokens, seq {s.seq}, batch {s.batch}, {s.steps} steps, rank {s.rank}, refresh every "
          f"{s.update_every}; corpus {info['bytes']['train']:,} train / {info['bytes']['heldout']:,} held-out "
          f"bytes of the Python {result['python']} standard library. {result['machine']}, "
          f"{s.threads} thread(s), torch {result['torch']}, wall {result['wall_s']:.0f} s.\n",
          _table(best, ratios, s), ""]
    (out / "results.md").write_text("\n".join(md))
    _plot(best, runs, out / "loss_curves.png")
    return result
