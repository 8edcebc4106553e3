"""Find target layers by pattern and replace them with adapter layers."""
from __future__ import annotations

import re
from typing import Callable

from torch import nn

from rankwise.errors import RankwiseError

try:  # transformers' GPT-2 style linear layer, weight stored (in, out)
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a dependency
    Conv1D = ()  # type: ignore[assignment]

# Last path segments of common output heads; "all-linear" never adapts these.
HEAD_NAMES = ("lm_head", "classifier", "score", "qa_outputs", "out_proj_head")


def is_linear_like(module: nn.Module) -> bool:
    """Return True for ``nn.Linear`` and transformers' ``Conv1D``."""
    return isinstance(module, nn.Linear) or (bool(Conv1D) and isinstance(module, Conv1D))


def _is_wrapped(path: str, wrapped_paths: set[str]) -> bool:
    return any(path.startswith(w + ".") for w in wrapped_paths)


def _head_paths(model: nn.Module) -> set[str]:
    heads = set()
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for path, module in model.named_modules():
        if out_emb is not None and module is out_emb:
            heads.add(path)
        if path.rsplit(".", 1)[-1] in HEAD_NAMES:
            heads.add(path)
    return heads


def matches(path: str, pattern: str) -> bool:
    """PEFT's list-entry rule: the full name, or a ``.``-separated suffix of it."""
    return path == pattern or path.endswith("." + pattern)


def find_targets(model: nn.Module, targets: list[str] | str,
                 exclude: list[str] | None = None) -> list[str]:
    """Return the paths of the linear layers selected by ``targets``.

    Args:
        model: The model to search.
        targets: ``"all-linear"`` (every linear layer except output heads), a regex string
            matched against the full module path, or a list of names/suffixes
            (``["query", "value"]`` matches ``...attention.self.query``).
        exclude: Names/suffixes never to adapt.

    Returns:
        Matching module paths in model order.

    Raises:
        RankwiseError: If nothing matches, or a match is not a supported layer type; the
            message lists a few real module names.
    """
    exclude = list(exclude or [])
    wrapped = {p for p, m in model.named_modules() if hasattr(m, "base_layer")}
    candidates = [(p, m) for p, m in model.named_modules()
                  if p and not _is_wrapped(p, wrapped) and not any(matches(p, e) for e in exclude)]
    if targets == "all-linear":
        heads = _head_paths(model)
        found = [p for p, m in candidates
                 if (is_linear_like(m) or hasattr(m, "base_layer")) and p not in heads]
    elif isinstance(targets, str):
        try:
            rx = re.compile(targets)
        except re.error as err:
            raise RankwiseError(f"targets regex {targets!r} is invalid: {err}") from None
        found = [p for p, m in candidates if rx.fullmatch(p)]
    else:
        found = [p for p, m in candidates if any(matches(p, t) for t in targets)]
    if not found:
        linear = [p for p, m in model.named_modules() if is_linear_like(m)]
        sample = ", ".join(sorted({p.rsplit(".", 1)[-1] for p in linear})[:8]) or "none"
        raise RankwiseError(
            f"targets {targets!r} matched no module; linear layers here end in: {sample} "
            f"(e.g. {linear[0] if linear else 'n/a'}); use such names or 'all-linear'"
        )
    modules = dict(model.named_modules())
    bad = [p for p in found if not (is_linear_like(modules[p]) or hasattr(modules[p], "base_layer"))]
    if bad:
        raise RankwiseError(
            f"targets {targets!r} matched {bad[0]!r} ({type(modules[bad[0]]).__name__}), which is "
            "not a linear layer; target nn.Linear or Conv1D modules"
        )
    return found


def inject(model: nn.Module, paths: list[str],
           wrap: Callable[[str, nn.Module], nn.Module]) -> dict[str, nn.Module]:
    """Replace each module at ``paths`` by ``wrap(path, module)``.

    ``wrap`` receives the existing module; if it is already an adapter layer it may add a
    new named adapter to it and return it unchanged.

    Args:
        model: The model to change in place.
        paths: Module paths from :func:`find_targets`.
        wrap: Builds the replacement.

    Returns:
        ``{path: new module}``.
    """
    out = {}
    for path in paths:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, child)
        new = wrap(path, old)
        if new is not old:
            setattr(parent, child, new)
        out[path] = new
    return out
