"""``rankwise inspect RUN_OR_MODEL``: gradient structure, Model Shapley and the low-rank inverse
bound of a trained run or a model (docs/inspect.md).

The maths lives in :mod:`rankwise.core.diagnostics`; this module wires it: it loads the model
(each point of a run: the base, every checkpoint of a full fine-tuning run, the final model),
draws calibration batches from the run's data config (or ``--data``), and writes ``report.md``,
``inspect.json`` (every number) and the plots into ``--out``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from rankwise import registry
from rankwise.core import atomic
from rankwise.core.diagnostics import (effective_ranks, inverse_bounds, mean_gradients,
                                       shapley_scores)
from rankwise.core.inject import find_targets
from rankwise.core.weights import base_layer, is_conv1d, shape, storage_param
from rankwise.engine import get_task
from rankwise.engine.loop import draw_batches
from rankwise.errors import RankwiseError
from rankwise.recipes import folders
from rankwise.recipes.config import RunConfig, load_run_config

CALIBRATION_BATCHES = 4   # batches per gradient / Shapley estimate (each a train batch)
INVERSE_LAYERS = 3        # layers whose input Gram matrices are checked against the bound
INVERSE_MAX_DIM = 512     # ... when their input width is at most this (eigh stays cheap)
SCALES = ("raw", "half", "small")  # which E: as measured, shrunk to ½ and 1/100 of the condition
DAMP = 0.01               # SparseGPT's damping: A = XᵀX/N + DAMP * mean(diag) * I


def target_weights(model: nn.Module, targets: Any) -> dict[str, nn.Parameter]:
    """``{path: stored weight}`` of the 2-D float weights of the targeted linear layers."""
    mods = dict(model.named_modules())
    out = {}
    for path in find_targets(model, targets, what="method.targets"):
        try:
            out[path] = storage_param(mods[path])
        except TypeError:  # a quantized base: its packed weight holds no gradient
            continue
    return out


def as_out_in(model: nn.Module, path: str, t: torch.Tensor) -> torch.Tensor:
    """A storage-layout tensor of layer ``path`` as ``(out, in)`` (GPT-2's Conv1D is transposed)."""
    return t.T if is_conv1d(base_layer(dict(model.named_modules())[path])) else t


def _inputs(target: Path, data: Path | None) -> tuple[RunConfig, str]:
    """The config to use and what ``target`` is (``train`` or ``model``)."""
    what = folders.kind(target) if Path(target).is_dir() else None
    if what not in ("train", "model"):
        held = folders.WHAT.get(what or "", "nothing rankwise can read") if what else "nothing (missing or empty)"
        raise RankwiseError(f"inspect: {target} is neither a run nor a model folder (it holds {held}); "
                            "pass the --out folder of 'rankwise train' or a transformers model folder")
    if what == "model" and data is None:
        raise RankwiseError(f"inspect: {target} is a model folder; pass --data CONFIG (a run config whose "
                            "data: section gives the calibration batches)")
    cfg = load_run_config(data if data is not None else Path(target) / "config.yaml", notice=data is not None)
    if what == "model":
        cfg.model.path = str(target)
    return cfg, what


def _states(target: Path, what: str, cfg: RunConfig, task, num_labels):
    """Yield ``(label, model)`` for each point of training that can be rebuilt."""
    from safetensors.torch import load_file

    from rankwise.recipes.checkpoint import list_checkpoints
    from rankwise.recipes.export import load_run
    from rankwise.recipes.model import load_model

    m = cfg.model
    base, tok = load_model(m.path, task, num_labels, seed=cfg.train.seed, dtype=m.dtype)
    yield "base", base, tok
    if what != "train":
        return
    full = registry.get("method", cfg.method.name).trains == "full"
    for ck in list_checkpoints(target) if full else []:
        model, _ = load_model(m.path, task, num_labels, seed=cfg.train.seed, dtype=m.dtype)
        model.load_state_dict(load_file(str(ck / "trainable.safetensors")), strict=False)
        yield ck.name, model, tok
    if (target / ("model" if full else "adapter")).is_dir():
        _, model, tok = load_run(target)
        yield "final", model, tok


def gradient_section(states: list[tuple[str, nn.Module]], targets: Any, batches: list[dict],
                     loss_fn: Callable) -> dict[str, Any]:
    """Per state and layer: singular values of the mean gradient, effective ranks, and every
    registered method's ``layer_score`` (GoRA's importance) of the same gradient."""
    # Methods built from a per-layer score of (W, G), e.g. GoRA's importance, found by capability.
    scorers = {n: e.layer_score for n in registry.names("method")
               if (e := registry.get("method", n)).layer_score is not None}
    out: dict[str, Any] = {}
    for label, model in states:
        weights = target_weights(model, targets)
        grads = mean_gradients(model, weights, batches, loss_fn)
        rows = {}
        for path, g in grads.items():
            g2 = as_out_in(model, path, g)
            s = torch.linalg.svdvals(g2.double())
            w2 = as_out_in(model, path, weights[path].detach().float())
            rows[path] = {"singular_values": [float(x) for x in s], **effective_ranks(s),
                          "layer_scores": {n: float(f(w2, g2)) for n, f in scorers.items()},
                          "grad_norm": float(s.norm())}
        out[label] = rows
    return {"layer_scores": sorted(scorers), "states": out}


def shapley_section(model: nn.Module, targets: Any, batches: list[dict], loss_fn: Callable,
                    fraction: float = 0.1) -> dict[str, Any]:
    """Per-neuron Model Shapley values and their top-``fraction`` overlap with first-order scores."""
    weights = target_weights(model, targets)
    flags = {p: p.requires_grad for p in model.parameters()}
    for p in flags:
        p.requires_grad_(False)
    for p in weights.values():
        p.requires_grad_(True)
    try:
        phi = shapley_scores(weights, batches, lambda b: loss_fn(model, b))
        grads = mean_gradients(model, weights, batches, loss_fn)
    finally:
        for p, f in flags.items():
            p.requires_grad_(f)
    scores = {"shapley": [], "grad": [], "grad_weight": []}
    layers = {}
    for path, w in weights.items():
        ph, g, th = (as_out_in(model, path, t.float()) for t in (phi[path], grads[path], w.detach()))
        neuron = ph.sum(-1)  # a neuron's value = the sum of its row's (grouped players, §4.3)
        scores["shapley"].append(neuron)
        scores["grad"].append(g.abs().sum(-1))
        scores["grad_weight"].append((g * th).abs().sum(-1))
        layers[path] = {"neurons": len(neuron), "sum": float(neuron.sum()), "max": float(neuron.max()),
                        "min": float(neuron.min())}
    flat = {k: torch.cat(v) for k, v in scores.items()}
    k = max(1, int(round(fraction * len(flat["shapley"]))))
    top = {name: set(v.topk(k).indices.tolist()) for name, v in flat.items()}
    starts = torch.tensor([0] + [layers[p]["neurons"] for p in layers]).cumsum(0).tolist()
    for (path, row), lo, hi in zip(layers.items(), starts, starts[1:]):
        row["top_fraction"] = sum(lo <= i < hi for i in top["shapley"]) / row["neurons"]
    return {"fraction": fraction, "top_k": k, "layers": layers,
            "overlap_with_shapley": {n: len(top[n] & top["shapley"]) / k for n in ("grad", "grad_weight")},
            "values": [float(x) for x in flat["shapley"]]}


def input_grams(model: nn.Module, paths: list[str], batches: list[dict],
                loss_fn: Callable) -> dict[str, torch.Tensor]:
    """``XᵀX / N`` of each layer's inputs over ``batches`` (every token position)."""
    mods = dict(model.named_modules())
    acc: dict[str, list] = {p: [0, 0] for p in paths}

    def hook(path):
        def fn(mod, args, output):
            x = args[0].detach().double().reshape(-1, args[0].shape[-1])  # (N, in)
            acc[path][0] = acc[path][0] + x.T @ x
            acc[path][1] += x.shape[0]
        return fn

    handles = [mods[p].register_forward_hook(hook(p)) for p in paths]
    try:
        with torch.no_grad():
            for b in batches:
                loss_fn(model, b)
    finally:
        for h in handles:
            h.remove()
    return {p: a / n for p, (a, n) in acc.items()}


def inverse_section(model: nn.Module, targets: Any, batches_a: list[dict], batches_b: list[dict],
                    loss_fn: Callable) -> dict[str, Any]:
    """The paper's bound vs the measured error and the naive bound on the layers' input Grams.

    A = Gram of batches A (+ damping), Ã = the same from batches B, E = Ã - A. ``raw`` uses that
    E; ``half`` and ``small`` shrink it to 4‖E‖ = ½ and 1/100 of min(λ_n, δ_{n-p}), so the
    paper's condition holds at every p (the raw E of two small batches is usually too large for
    it). Layers that share their input (query/key/value) are checked once.
    """
    mods = dict(model.named_modules())
    paths = [p for p in find_targets(model, targets, what="method.targets")
             if min(shape(mods[p])[1], INVERSE_MAX_DIM + 1) <= INVERSE_MAX_DIM]
    ga, gb = input_grams(model, paths, batches_a, loss_fn), input_grams(model, paths, batches_b, loss_fn)
    out: dict[str, Any] = {}
    for path in paths:
        a, at = ga[path], gb[path]
        if len(out) == INVERSE_LAYERS or any(a.shape == ga[q].shape and torch.equal(a, ga[q]) for q in out):
            continue
        n = a.shape[0]
        a = a + DAMP * float(torch.diagonal(a).mean()) * torch.eye(n, dtype=a.dtype)
        e = at - ga[path]
        ps = sorted({1, max(1, n // 8), max(1, n // 4), max(1, n // 2), n - 1})
        rows = {"raw": [inverse_bounds(a, e, p) for p in ps]}
        for name, frac in (("half", 0.5), ("small", 0.01)):
            rows[name] = []
            for r in rows["raw"]:
                t = frac * min(r["lambda_n"], r["gap"]) / 4 / r["norm_e"] if r["norm_e"] > 0 else 0.0
                rows[name].append({**inverse_bounds(a, t * e, r["p"]), "scale": t})
        out[path] = {"n": n, **rows}
    cases = [r for v in out.values() for k in SCALES for r in v[k] if r["bound"] is not None]
    return {"damping": DAMP, "matrices": out, "applicable_cases": len(cases),
            "bound_held_everywhere": all(r["measured"] <= r["bound"] * (1 + 1e-9) for r in cases)}


def run_inspect(target: Path, data: Path | None, out: Path, n_batches: int = CALIBRATION_BATCHES,
                device: str = "cpu", plots: bool = True) -> dict[str, Any]:
    """Write ``report.md``, ``inspect.json`` and plots for ``target`` into ``out``.

    Args:
        target: A ``rankwise train`` run folder or a transformers model folder.
        data: A run config whose ``data:`` (and ``train.batch_size``/``seed``) gives the
            calibration batches; default: the run's own ``config.yaml``.
        out: The output folder: new, empty or an earlier inspect report (its files are
            replaced; ``rankwise.json`` records the kind).
        n_batches: Calibration batches per estimate.
        device: Where the model runs.
        plots: Also write the PNGs (matplotlib); ``report.md`` and ``inspect.json`` always.

    Returns:
        The JSON written to ``inspect.json``.

    Raises:
        RankwiseError: If ``target`` is neither a run nor a model, the data config is bad, or
            ``out`` holds anything but an earlier inspect report.
    """
    from rankwise.data.text import build_data

    target, out = Path(target), atomic.check_folder(out)
    folders.check_writable(out, "inspect", "inspect")  # never into a run or the user's files
    cfg, what = _inputs(target, data)
    task = get_task(cfg.task.name)
    targets = getattr(cfg.method, "targets", "all-linear")
    states, tokenizer = [], None
    for label, model, tok in _states(target, what, cfg, task, cfg.model.num_labels):
        if tokenizer is None:
            tokenizer = tok
            train_data, _ = build_data(cfg.data, task, tokenizer, progress=False)
        states.append((label, model.to(device).eval()))
    t = cfg.train
    draw = lambda i, off: draw_batches(train_data, task, i, t.batch_size, t.seed + off, device)[0]  # noqa: E731
    calib = [draw(i, 1) for i in range(n_batches)]
    other = [draw(i, 2) for i in range(n_batches)]
    last = states[-1][1]
    report = {"target": str(target), "kind": what, "targets": targets, "calibration_batches": n_batches,
              "batch_size": t.batch_size,
              "gradients": gradient_section(states, targets, calib, task.mean_loss),
              "shapley": shapley_section(last, targets, calib, task.mean_loss),
              "inverse": inverse_section(last, targets, calib, other, task.mean_loss)}
    out.mkdir(parents=True, exist_ok=True)
    folders.record(out, "inspect")
    atomic.write_json(out / "inspect.json", report)
    from rankwise.commands.inspect.report import write_plots, write_report
    if plots:
        write_plots(report, out)
    write_report(report, out)
    return report

