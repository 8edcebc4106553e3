"""The one target-selection language, and module surgery (replace a module by another).

Every part of rankwise that picks layers - adapter methods (``method.targets``), low-rank
optimizers (``optim.targets``), compression - speaks the same language:

* ``"all-linear"``: every linear layer except output heads (PEFT's spelling);
* ``"block-linear"``: the linear layers inside the repeated transformer blocks (a numeric
  segment in the module path such as ``layers.3``), heads excluded (GaLore's choice);
* any other string: a regular expression matched against the whole module path;
* a list: names or ``.``-separated suffixes of module paths (``["q_proj", "v_proj"]``,
  PEFT's rule).

Linear layers are ``nn.Linear`` (and its subclasses, such as bitsandbytes' quantized linears)
and transformers' GPT-2 ``Conv1D``; a layer already wrapped by an adapter counts as its base.

Fused 3-D parameters (a mixture-of-experts block's ``mlp.experts.gate_up_proj``, which no
``nn.Linear`` holds) are selected separately, by parameter name or suffix
(:func:`find_parameter_targets`, PEFT's ``target_parameters`` rule).
"""
from __future__ import annotations

import re
import sys
from typing import Callable

from torch import nn

from rankwise.errors import RankwiseError

# Last path segments of common output heads; "all-linear" never adapts these.
HEAD_NAMES = ("lm_head", "classifier", "score", "qa_outputs", "out_proj_head")
# Children that hold a task head trained beside any adapter (PEFT does the same for SEQ_CLS).
HEAD_CHILDREN = ("classifier", "score", "qa_outputs")
KEYWORDS = ("all-linear", "block-linear")
# A module path with a numeric segment (``model.layers.3.mlp.up_proj``) sits inside a
# ``ModuleList`` of blocks; that is how "in the transformer blocks" is recognised.
_BLOCK_SEGMENT = re.compile(r"(^|\.)\d+(\.|$)")


def conv1d_class() -> type | None:
    """transformers' ``Conv1D`` if transformers is already imported, else None.

    A model can only hold a ``Conv1D`` once transformers is loaded, so rankwise never imports
    transformers just to ask.
    """
    mod = sys.modules.get("transformers.pytorch_utils")
    return getattr(mod, "Conv1D", None)


def is_conv1d(module: nn.Module) -> bool:
    """True for transformers' ``Conv1D`` (weight stored ``(in, out)``)."""
    cls = conv1d_class()
    return cls is not None and isinstance(module, cls)


def is_linear_like(module: nn.Module) -> bool:
    """True for ``nn.Linear`` (and subclasses) and transformers' ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_wrapped(module: nn.Module) -> bool:
    """True for a module that wraps another as ``base_layer`` (an adapter layer)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module)


def is_wrapped_linear(module: nn.Module) -> bool:
    """True for an adapter layer whose innermost ``base_layer`` is linear-like (a prompt
    wrapper of the input embeddings is wrapped too, but not a linear layer)."""
    while is_wrapped(module):
        module = module.base_layer
    return is_linear_like(module)


def head_paths(model: nn.Module) -> set[str]:
    """Paths of the model's output heads (its output embeddings and :data:`HEAD_NAMES`)."""
    heads = set()
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for path, module in model.named_modules():
        if out_emb is not None and module is out_emb:
            heads.add(path)
        if path.rsplit(".", 1)[-1] in HEAD_NAMES:
            heads.add(path)
    return heads


def default_heads(model: nn.Module) -> list[str]:
    """Task-head children trained beside any adapter (``classifier``, ``score``, ...)."""
    return [n for n, _ in model.named_children() if n in HEAD_CHILDREN]


def matches(path: str, pattern: str) -> bool:
    """PEFT's list-entry rule: the full name, or a ``.``-separated suffix of it."""
    return path == pattern or path.endswith("." + pattern)


def in_block(path: str) -> bool:
    """True if ``path`` lies inside a numbered block (``encoder.layer.3.output.dense``)."""
    return bool(_BLOCK_SEGMENT.search(path))


def find_targets(model: nn.Module, targets: list[str] | str,
                 exclude: list[str] | None = None, what: str = "targets",
                 allow_empty: bool = False) -> list[str]:
    """Return the paths of the linear layers selected by ``targets`` (see the module docstring).

    Args:
        model: The model to search.
        targets: ``"all-linear"``, ``"block-linear"``, a regex string, or a list of
            names/suffixes.
        exclude: Names/suffixes never selected.
        what: The config key named in error messages (``"method.targets"``).
        allow_empty: Return ``[]`` instead of raising when nothing matches.

    Returns:
        Matching module paths in model order (adapter layers count as their base layer).

    Raises:
        RankwiseError: If nothing matches, or a match is not a linear layer; the message
            lists a few real module names.
    """
    exclude = list(exclude or [])
    wrapped = {p for p, m in model.named_modules() if is_wrapped(m)}
    candidates = [(p, m) for p, m in model.named_modules()
                  if p and not any(p.startswith(w + ".") for w in wrapped)
                  and not any(matches(p, e) for e in exclude)]
    linear = [(p, m) for p, m in candidates if is_linear_like(m) or is_wrapped_linear(m)]
    if targets in KEYWORDS:
        heads = head_paths(model)
        found = [p for p, _ in linear if p not in heads and (targets == "all-linear" or in_block(p))]
    elif isinstance(targets, str):
        try:
            rx = re.compile(targets)
        except re.error as err:
            raise RankwiseError(f"{what} regex {targets!r} is invalid: {err}") from None
        found = [p for p, _ in candidates if rx.fullmatch(p)]
    else:
        found = [p for p, _ in candidates if any(matches(p, t) for t in targets)]
    if not found and allow_empty:
        return []
    if not found:
        names = [p for p, m in model.named_modules() if is_linear_like(m)]
        sample = ", ".join(sorted({p.rsplit(".", 1)[-1] for p in names})[:8]) or "none"
        raise RankwiseError(
            f"{what} {targets!r} matched no module; linear layers here end in: {sample} "
            f"(e.g. {names[0] if names else 'n/a'}); use such names or 'all-linear'")
    modules = dict(model.named_modules())
    bad = [p for p in found if not (is_linear_like(modules[p]) or is_wrapped_linear(modules[p]))]
    if bad:
        raise RankwiseError(
            f"{what} {targets!r} matched {bad[0]!r} ({type(modules[bad[0]]).__name__}), which "
            "is not a linear layer; target nn.Linear or Conv1D modules")
    return found


def unwrapped_path(path: str) -> str:
    """``path`` with every ``base_layer`` segment removed: where a module sits in the base model
    (``mlp.experts.base_layer`` -> ``mlp.experts``)."""
    return ".".join(part for part in path.split(".") if part != "base_layer")


def find_parameter_targets(model: nn.Module, names: list[str], exclude: list[str] | None = None,
                           what: str = "target_parameters") -> dict[str, list[str]]:
    """Return the fused 3-D parameters (mixture-of-experts weights) that ``names`` select.

    A name selects the parameter ``<module path>.<parameter name>`` that it equals or ends
    (``.``-separated), PEFT's ``target_parameters`` rule; module paths are read without adapter
    wrappers (``base_layer`` segments), so a module that already holds an adapter on its
    parameters is found again under its own path.

    Args:
        model: The model to search.
        names: Parameter names or suffixes (``["mlp.experts.gate_up_proj"]``).
        exclude: Module names/suffixes never selected (as for module targets).
        what: The config key named in error messages.

    Returns:
        ``{module path: [parameter names]}`` in model and registration order.

    Raises:
        RankwiseError: If nothing matches (listing a few 3-D parameters of the model), or a
            match is not 3-D (naming ``method.targets`` for linear layers).
    """
    from rankwise.core.protocol import adapter_modules
    exclude = list(exclude or [])
    adapter_ids = {id(p) for _, m in adapter_modules(model) for n in m.adapter_names()
                   for p in m.adapter_params(n).values()}
    owned = [(unwrapped_path(path), pname, p, module) for path, module in model.named_modules()
             for pname, p in module.named_parameters(recurse=False) if id(p) not in adapter_ids]
    found: dict[str, list[str]] = {}
    bad: list[tuple[str, tuple, str, nn.Module]] = []
    for home, pname, p, module in owned:
        if any(matches(home, e) for e in exclude):
            continue
        key = f"{home}.{pname}" if home else pname
        if not any(matches(key, n) for n in names):
            continue
        if p.dim() == 3:
            found.setdefault(home, []).append(pname)
        else:
            bad.append((key, tuple(p.shape), home, module))
    if bad:
        key, shape, home, module = bad[0]
        fix = ("target the layer with method.targets instead" if is_linear_like(module)
               else f"target nn.Linear layers with method.targets, or train the whole module "
                    f"with method.modules_to_save (e.g. {home!r})")
        raise RankwiseError(f"{what} {names!r} matched {key!r} of shape {shape}, which is not a "
                            f"fused 3-D expert parameter (experts, out, in); {fix}")
    if not found:
        fused = [(f"{home}.{n}" if home else n, tuple(t.shape)) for home, n, t, _ in owned if t.dim() == 3]
        if not fused:
            raise RankwiseError(f"{what} {names!r} matched nothing: this model has no 3-D (fused "
                                "expert) parameters; adapt its linear layers with method.targets")
        kinds = dict.fromkeys(f"{'.'.join(k.split('.')[-3:])} {s}" for k, s in fused)
        raise RankwiseError(f"{what} {names!r} matched no parameter; 3-D parameters here: "
                            f"{', '.join(list(kinds)[:4])} (e.g. {fused[0][0]}); use such names "
                            "or suffixes")
    return found


def replace_module(model: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``path`` in ``model``; returns the module that was there."""
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


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

    Raises:
        RankwiseError: What ``wrap`` raises, prefixed with the module's path.
    """
    out = {}
    for path in paths:
        old = model.get_submodule(path)
        try:
            new = wrap(path, old)
        except RankwiseError as err:  # the layer's own check (a rank above its width): name it
            raise RankwiseError(f"{path}: {err}") from None
        if new is not old:
            replace_module(model, path, new)
        out[path] = new
    return out
