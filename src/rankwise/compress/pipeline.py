"""Compress a model layer by layer, streaming calibration activations block by block.

The inputs of the first transformer block are captured once (a pre-hook stops the forward
there). Then, block by block: one pass of the block over the calibration batches accumulates
each target layer's input Gram matrix ``H = XᵀX / n`` (forward hooks), the compressor turns
each target weight into its compact form and the decoded weight replaces it, an optional
block refinement runs (3BASiL's transformer matching, against the dense block's outputs on the
same inputs), and a second pass of the now-compressed block produces the next block's inputs.
Only one block's activations (plus, with refinement, its dense outputs) are alive at a time.
Targets outside the numbered blocks (BERT's pooler) are compressed last, from one pass of the
whole (already compressed) model.
"""
from __future__ import annotations

import inspect
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from rankwise.compress.base import Compressed, Compressor, relative_error
from rankwise.core.inject import find_targets, is_wrapped
from rankwise.core.weights import dense_weight, shape, storage_param, to_storage_layout
from rankwise.errors import RankwiseError

_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")


@dataclass
class Result:
    """What :func:`compress_model` did.

    Attributes:
        layers: ``{module path: Compressed}`` in the order they were compressed.
        report: ``{module path: {"rel_error", "shape", "bytes_before", "bytes_after",
            "params_before", "params_after", "seconds", ...method info}}``.
        seconds: Wall time of the whole pass.
        held_bytes: The most bytes of calibration activations (a block's inputs, the dense
            block's outputs when kept, and the Gram matrices) alive at one time.
    """

    layers: dict[str, Compressed] = field(default_factory=dict)
    report: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    held_bytes: int = 0


class _Stop(Exception):
    """Raised by the capture hook to end a forward pass at the first block."""


class _Gram:
    """Forward hook accumulating ``Σ x xᵀ`` (float64) and the row count of a linear's input."""

    def __init__(self, n_in: int) -> None:
        self.sum = torch.zeros(n_in, n_in, dtype=torch.float64)
        self.rows = 0

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()           # (rows, in)
        self.sum += (x.T @ x).double().cpu()
        self.rows += x.shape[0]

    def hessian(self) -> torch.Tensor:
        """``XᵀX / n`` in float32."""
        return (self.sum / max(self.rows, 1)).float()


def split_blocks(model: nn.Module, paths: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """Group target paths by their transformer block.

    Returns:
        ``([(block path, [paths relative to the block])], [paths outside the blocks])``: the
        blocks of the first block list that holds a target, in model order; targets in any other
        list or outside blocks go to the second list.
    """
    blocks: dict[str, list[str]] = {}
    rest = []
    parent = None
    for p in paths:
        m = _BLOCK.match(p)
        block = m.group(1) if m else None
        if block is not None and parent is None:
            parent = block.rsplit(".", 1)[0]
        if block is None or block.rsplit(".", 1)[0] != parent or block == p:
            rest.append(p)
            continue
        blocks.setdefault(block, []).append(p[len(block) + 1:])
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(blocks.items(), key=lambda kv: order[kv[0]]), rest


def _forward_kwargs(model: nn.Module) -> dict[str, Any]:
    params = inspect.signature(model.forward).parameters
    return {"use_cache": False} if "use_cache" in params else {}


def _capture(model: nn.Module, block: nn.Module, batches: list[dict]) -> list[tuple]:
    """``[(hidden states, other args, kwargs)]`` entering ``block`` for every batch."""
    captured = []

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        captured.append((hidden, args[1:], kw))
        raise _Stop

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    extra = _forward_kwargs(model)
    try:
        for batch in batches:
            try:
                model(**batch, **extra)
            except _Stop:
                pass
    finally:
        handle.remove()
    if len(captured) != len(batches):
        raise RuntimeError("the first transformer block was not called once per batch")
    return captured


def _run(block: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    out = block(hidden, *args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def _nbytes(items: list) -> int:
    """Bytes of the tensors in a list of tensors or of ``(hidden, args, kwargs)`` captures."""
    total = 0
    for item in items:
        for t in (item if isinstance(item, tuple) else (item,))[:1]:
            total += t.numel() * t.element_size()
    return total


def _write(module: nn.Module, weight: torch.Tensor) -> None:
    param = storage_param(module)
    with torch.no_grad():
        param.copy_(to_storage_layout(module, weight).to(param.dtype))


def check_layers(model: nn.Module, compressor: Compressor, targets) -> list[str]:
    """Find the target layers and check the config against each (before any work).

    Returns:
        The target paths.

    Raises:
        RankwiseError: Adapter layers still present, or every per-layer problem at once
            (a rank larger than a layer, a pattern or group that does not tile it).
    """
    if any(is_wrapped(m) for m in model.modules()):
        raise RankwiseError("the model still has adapter layers; merge them first "
                            "(rankwise export RUN --format merged) or pass the run folder as model.path")
    paths = find_targets(model, targets, what="compress.targets")
    problems = [p for path in paths
                for p in compressor.config.layer_problems(path, shape(model.get_submodule(path)))]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise RankwiseError("compress." + "; compress.".join(problems[:3]) + more)
    return paths


def _hooked(owner: nn.Module, rel_paths: list[str]) -> tuple[dict[str, _Gram], list]:
    """Attach a :class:`_Gram` to each of ``owner``'s target layers; return them and the handles."""
    grams = {r: _Gram(shape(owner.get_submodule(r))[1]) for r in rel_paths}
    return grams, [owner.get_submodule(r).register_forward_hook(g) for r, g in grams.items()]


@dataclass
class _Pass:
    """What the layer steps of one :func:`compress_model` call share."""

    compressor: Compressor
    result: Result
    total: int
    on_layer: Callable[[str, int, int], None] | None


def _compress_layers(run: _Pass, owner: nn.Module, prefix: str, rel_paths: list[str],
                     grams: dict[str, _Gram]) -> dict[str, Compressed]:
    """Compress each layer from its Gram matrix and write the decoded weight back."""
    done = {}
    for rel in rel_paths:
        module = owner.get_submodule(rel)
        t0 = time.perf_counter()
        w = dense_weight(module).detach().float().clone()
        h = grams[rel].hessian()
        comp = run.compressor.compress(w.clone(), h)
        _write(module, comp.weight)
        done[rel] = comp
        path = f"{prefix}{rel}"
        run.result.report[path] = {"shape": list(w.shape), "seconds": time.perf_counter() - t0,
                                   "_weight": w, "_hessian": h}
        if run.on_layer:
            run.on_layer(path, len(run.result.report), run.total)
    return done


def _finish(run: _Pass, prefix: str, layers: dict[str, Compressed], owner: nn.Module) -> None:
    """Write the final weights and complete each layer's report line (error, sizes, info)."""
    for rel, comp in layers.items():
        path = f"{prefix}{rel}"
        _write(owner.get_submodule(rel), comp.weight)
        line = run.result.report[path]
        w, h = line.pop("_weight"), line.pop("_hessian")
        line.update({"rel_error": relative_error(w, comp.weight, h),
                     "bytes_before": w.numel() * run.compressor.value_dtype.itemsize,
                     "bytes_after": comp.nbytes, "params_before": w.numel(),
                     "params_after": comp.params, **comp.info})
        run.result.layers[path] = comp


def _compress_blocks(run: _Pass, model: nn.Module, batches: list[dict],
                     blocks: list[tuple[str, list[str]]]) -> None:
    """Block by block: Gram pass, compress, optional refinement, then the next block's inputs."""
    compressor, result = run.compressor, run.result
    first = model.get_submodule(blocks[0][0])
    inputs = _capture(model, first, batches)
    for block_path, rel_paths in blocks:
        block = model.get_submodule(block_path)
        grams, handles = _hooked(block, rel_paths)
        try:
            dense_out = [_run(block, *x) for x in inputs]
            if not compressor.refines_blocks:
                dense_out = []      # only a refinement needs the dense targets
        finally:
            for hd in handles:
                hd.remove()
        result.held_bytes = max(result.held_bytes, _nbytes(inputs) + _nbytes(dense_out)
                                + sum(g.sum.numel() * 8 for g in grams.values()))
        layers = _compress_layers(run, block, block_path + ".", rel_paths, grams)
        if compressor.refines_blocks:
            def forward(i: int, block=block) -> torch.Tensor:
                return _run(block, *inputs[i])
            layers = compressor.refine_block(block, layers, forward, dense_out)
        _finish(run, block_path + ".", layers, block)
        del dense_out
        inputs = [(_run(block, *x), x[1], x[2]) for x in inputs]
    del inputs


def _compress_rest(run: _Pass, model: nn.Module, batches: list[dict], rest: list[str]) -> None:
    """The targets outside the blocks, from one pass of the whole (compressed) model."""
    grams, handles = _hooked(model, rest)
    extra = _forward_kwargs(model)
    try:
        for batch in batches:
            model(**batch, **extra)
    finally:
        for hd in handles:
            hd.remove()
    _finish(run, "", _compress_layers(run, model, "", rest, grams), model)


def compress_model(model: nn.Module, compressor: Compressor, batches: list[dict[str, torch.Tensor]],
                   targets: Any = "all-linear",
                   on_layer: Callable[[str, int, int], None] | None = None) -> Result:
    """Compress every target layer of ``model`` in place (decoded weights written back).

    Args:
        model: A transformers model (or any module whose targets sit in numbered blocks).
        compressor: The configured :class:`~rankwise.compress.base.Compressor`.
        batches: Calibration batches (model inputs, no labels needed).
        targets: rankwise's target language (``"all-linear"``, a regex, a list of suffixes).
        on_layer: Called as ``on_layer(path, done, total)`` after each layer (progress bars).

    Returns:
        The :class:`Result` with each layer's compact form and report line.

    Raises:
        RankwiseError: See :func:`check_layers`.
    """
    began = time.perf_counter()
    paths = check_layers(model, compressor, targets)
    compressor.value_dtype = dense_weight(model.get_submodule(paths[0])).dtype
    blocks, rest = split_blocks(model, paths)
    result = Result()
    run = _Pass(compressor, result, len(paths), on_layer)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if blocks:
                _compress_blocks(run, model, batches, blocks)
            if rest:
                _compress_rest(run, model, batches, rest)
    finally:
        model.train(was_training)
    result.layers = {p: result.layers[p] for p in paths}
    result.report = {p: result.report[p] for p in paths}
    result.seconds = time.perf_counter() - began
    return result
