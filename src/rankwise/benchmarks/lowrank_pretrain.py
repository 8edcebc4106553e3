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
and step-time ratios to AdamW are measured under the same conditions.
"""
from __future__ import annotations

import copy
import json
import math
import platform
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.optim.common import split_params, state_bytes

METHODS = ("adamw", "adamw-split", "galore-torch", "galore", "galore-eigh", "galore-is", "sumo", "q3r",
           "ngn-m")
# "galore-eigh" is rankwise's galore with its two step-time options on: Gram eigh instead of
# the SVD, and refreshes staggered over the period. "adamw-split" is a control: full AdamW with
# GaLore's per-group learning rates (block matrices at lr * 0.25, GaLore's scale; the rest at lr).


@dataclass
class Sizes:
    """Everything that sets the benchmark's size (chosen to fit ~10 min on 2 shared CPU cores).

    Attributes:
        hidden, layers, heads, intermediate: The Llama shape.
        seq: Bytes per training window.
        batch: Windows per step.
        steps: Optimizer steps per run.
        eval_windows: Held-out windows for the final loss.
        rank: Subspace rank of projected matrices (and Q3R's target rank).
        update_every: Subspace refresh period (Q3R's reweighting period is its own default).
        lrs: Learning-rate grid per method (NGN-M: its ``c``).
        threads: torch intra-op threads.
        seed: Seed of the initial weights and of the batch order.
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
    lrs: dict = field(default_factory=lambda: {
        "adamw": [1e-3, 3e-3, 1e-2], "adamw-split": [1e-2, 3e-2, 1e-1], "galore-torch": [1e-2, 3e-2, 1e-1], "galore": [1e-2, 3e-2, 1e-1],
        "galore-eigh": [1e-2, 3e-2, 1e-1], "galore-is": [1e-2, 3e-2, 1e-1], "sumo": [3e-3, 1e-2, 3e-2],
        "q3r": [1e-3, 3e-3, 1e-2], "ngn-m": [0.1, 0.3, 1.0]})
    threads: int = 1
    seed: int = 0


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


def _windows(data: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    idx = starts[:, None] + torch.arange(seq)[None, :]  # (B, T)
    return data[idx].long()


def make_optimizer(method: str, model: nn.Module, lr: float, s: Sizes) -> torch.optim.Optimizer:
    """The optimizer under test (the peer from ``galore_torch``, the rest from the registry)."""
    common = {"rank": s.rank, "update_every": s.update_every}
    if method == "galore-torch":
        import galore_torch
        proj, plain = split_params(model)
        groups = [{"params": [p for _, p in plain]},
                  {"params": [p for _, p in proj], "rank": s.rank, "update_proj_gap": s.update_every,
                   "scale": 0.25, "proj_type": "std"}]
        return galore_torch.GaLoreAdamW(groups, lr=lr, eps=1e-6, no_deprecation_warning=True)
    if method == "adamw-split":
        proj, plain = split_params(model)
        return torch.optim.AdamW([{"params": [p for _, p in plain]},
                                  {"params": [p for _, p in proj], "lr": lr * 0.25}],
                                 lr=lr, eps=1e-6, weight_decay=0.0)
    over = {"adamw": {"eps": 1e-6}, "galore": {**common, "eps": 1e-6}, "galore-is": {**common, "eps": 1e-6},
            "galore-eigh": {**common, "eps": 1e-6, "svd": "eigh", "stagger": True},
            "sumo": {**common, "eps": 1e-6}, "q3r": {"rank": s.rank, "eps": 1e-6}, "ngn-m": {}}[method]
    name = "galore" if method == "galore-eigh" else method
    entry = registry.get("optimizer", name)
    return entry.builder(model, from_dict(entry.config_cls, {"name": name, "lr": lr, **over}, "optim"))


def formula_floats(method: str, model: nn.Module, r: int) -> int:
    """Optimizer-state floats the method's formula predicts for ``model``."""
    proj, plain = split_params(model)
    dense = sum(p.numel() for _, p in plain)
    mats = [tuple(p.shape) for _, p in proj]
    if method in ("adamw", "adamw-split"):
        return 2 * (dense + sum(m * n for m, n in mats))
    if method in ("galore", "galore-eigh", "galore-is", "galore-torch"):
        return 2 * dense + sum(2 * max(m, n) * r + min(m, n) * r for m, n in mats)
    if method == "sumo":
        return 2 * dense + sum(max(m, n) * r + min(m, n) * r for m, n in mats)
    if method == "q3r":
        return 2 * dense + sum(2 * m * n + (m + n) * r + r for m, n in mats)
    return dense + sum(m * n for m, n in mats)  # ngn-m: one displacement buffer


def counted_state_bytes(opt: torch.optim.Optimizer) -> int:
    """State bytes from the tensors in ``opt.state`` (plus galore-torch's projector object)."""
    total = state_bytes(opt)
    for st in opt.state.values():
        proj = st.get("projector")
        if proj is not None and torch.is_tensor(getattr(proj, "ortho_matrix", None)):
            total += proj.ortho_matrix.numel() * proj.ortho_matrix.element_size()
    return total


@torch.no_grad()
def heldout_loss(model: nn.Module, windows: torch.Tensor) -> float:
    """Mean next-byte cross-entropy (nats) over the held-out windows."""
    model.eval()
    losses = [float(model(input_ids=w, labels=w).loss) for w in windows.split(16)]
    model.train()
    return sum(losses) / len(losses)


def train_one(method: str, lr: float, s: Sizes, train: torch.Tensor, evalw: torch.Tensor,
              starts: torch.Tensor) -> dict:
    """Train one (method, learning rate) and measure it.

    Returns:
        Curves, held-out loss, state bytes (counted and formula), step times.
    """
    model = build_model(s)
    opt = make_optimizer(method, model, lr, s)
    warm = max(1, s.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / warm if k < warm else
                                              0.1 + 0.45 * (1 + math.cos(math.pi * (k - warm) / (s.steps - warm))))
    curve, step_t, opt_t, fb_t = [], [], [], []
    for k in range(s.steps):
        x = _windows(train, starts[k], s.seq)  # (B, T) bytes
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        sched.step()
        step_t.append(t2 - t0)
        opt_t.append(t2 - t1)
        fb_t.append(t1 - t0)
        curve.append(loss.item())
        if not math.isfinite(curve[-1]):
            break
    out = {"method": method, "lr": lr, "train_curve": curve, "diverged": not math.isfinite(curve[-1]),
           "heldout_loss": heldout_loss(model, evalw) if math.isfinite(curve[-1]) else float("nan"),
           "state_bytes": counted_state_bytes(opt), "formula_bytes": 4 * formula_floats(method, model, s.rank),
           "param_bytes": sum(p.numel() * 4 for p in model.parameters()),
           "step_s": sum(step_t) / len(step_t), "opt_step_s": sum(opt_t) / len(opt_t),
           "max_opt_step_s": max(opt_t),
           "fwd_bwd_median_s": sorted(fb_t)[len(fb_t) // 2]}
    if method in ("q3r", "adamw") and not out["diverged"]:
        from rankwise.optim.q3r import truncate_to_factorized
        small = copy.deepcopy(model)
        truncate_to_factorized(small, s.rank)
        out["heldout_loss_truncated"] = heldout_loss(small, evalw)
    if hasattr(opt, "loss_hook"):
        opt.loss_hook.remove()
    return out


def peak_tensor_mib(method: str, lr: float, s: Sizes, x: torch.Tensor) -> dict | None:
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
    model = build_model(s)
    opt = make_optimizer(method, model, lr, s)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            tracker.reset_mod_stats()
    snap = tracker.get_tracker_snapshot("peak")
    cpu = next(iter(snap.values()))
    opt_key = next(k for k in cpu if str(k).endswith("OPT"))
    if hasattr(opt, "loss_hook"):
        opt.loss_hook.remove()
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
            f"{r['formula_bytes'] / 2**20:.3f} | {(2 * r['param_bytes'] + r['state_bytes']) / 2**20:.2f} | "
            f"{_peak(r)} | {ratios[m]['step']:.2f} | "
            f"{ratios[m]['step_common_fb']:.2f} | {ratios[m]['opt_step']:.2f} | "
            f"{ratios[m]['refresh_step_ms']:.0f} |")
    return "\n".join(lines)


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
        methods: Which optimizers to run (``adamw`` is always included: it is the time base;
            ``galore-torch`` is left out when the package is not installed).

    Returns:
        The results dict written to ``results.json``.
    """
    s = sizes or Sizes()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    t_start = time.time()
    try:
        train, held, info = load_corpus()
        g = torch.Generator().manual_seed(s.seed)
        starts = torch.randint(0, train.numel() - s.seq, (s.steps, s.batch), generator=g)
        eval_starts = torch.randint(0, held.numel() - s.seq, (s.eval_windows,), generator=g)
        evalw = _windows(held, eval_starts, s.seq)
        methods = tuple(dict.fromkeys(("adamw",) + tuple(methods)))
        try:
            import galore_torch  # noqa: F401  (the peer: the bench-only extra)
        except ImportError:
            methods = tuple(m for m in methods if m != "galore-torch")
        runs = []
        for i in range(max(len(s.lrs[m]) for m in methods)):
            for m in methods:
                if i < len(s.lrs[m]):
                    runs.append(train_one(m, s.lrs[m][i], s, train, evalw, starts))
    finally:
        torch.set_num_threads(threads)
    best = {}
    for m in methods:
        ok = [r for r in runs if r["method"] == m and math.isfinite(r["heldout_loss"])]
        best[m] = min(ok, key=lambda r: r["heldout_loss"]) if ok else [r for r in runs if r["method"] == m][0]
        best[m]["peak_mib"] = peak_tensor_mib(m, best[m]["lr"], s, _windows(train, starts[0], s.seq))

    def mean(m, key):
        vals = [r[key] for r in runs if r["method"] == m and not r["diverged"]]
        return sum(vals) / max(len(vals), 1)
    # Forward+backward is the same work for every method; under a shared machine its time is
    # mostly noise from other processes, so a second ratio uses one common (median) value for it.
    fb = sorted(r["fwd_bwd_median_s"] for r in runs)[len(runs) // 2]
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
