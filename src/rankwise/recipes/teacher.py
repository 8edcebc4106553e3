"""A frozen teacher for distillation: a transformers causal-LM folder, a finished ``rankwise
train`` run (its adapters merged, as ``export --format merged`` writes it), or a ``tiny-*`` test
model. ``rankwise distill`` (Low-Rank Clone) loads its teacher here, and so does the ``gkd`` task
(on-policy distillation) through :attr:`rankwise.engine.task.Task.teacher_loader`, which the
train recipe points at :func:`load_teacher`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from rankwise.errors import RankwiseError
from rankwise.recipes.model import TINY, dtype_kwargs, load_model, torch_dtype


def load_teacher(path: str | Path, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 what: str = "teacher", check: Callable[[Any], None] | None = None
                 ) -> tuple[nn.Module, Any]:
    """The teacher model (in eval mode, on ``device``, in ``dtype``) and its tokenizer.

    Args:
        path: A transformers model folder (``config.json``), a finished run folder
            (``config.yaml``; its adapters are merged into the base) or a ``tiny-*`` name (an
            in-code test model seeded by ``seed``, with the packaged MiniLM tokenizer).
        device: Where the model goes.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        seed: Seeds a ``tiny-*`` model's weights.
        what: How error messages name the path (``distill: TEACHER``, ``task.teacher``).
        check: Called with the model's transformers config before the weights are read
            (a model folder) or after the merge (a run); raises to refuse the teacher.

    Returns:
        ``(model, tokenizer)``; the tokenizer is ``None`` for a model folder without one.

    Raises:
        RankwiseError: A path that does not exist, a folder that is neither a model nor a run
            folder, a run that is not finished, or what ``check`` raises.
    """
    t = torch_dtype(dtype)
    if str(path) in TINY:
        model, tok = load_model(str(path), "causal-lm", seed=seed, dtype=dtype)
        if check is not None:
            check(model.config)
        return model.to(device).eval(), tok
    folder = Path(path).expanduser()
    if (folder / "config.yaml").is_file() and not (folder / "config.json").is_file():
        from rankwise.core.merged import merge_plain
        from rankwise.recipes.export import load_run
        _, model, tok = load_run(folder)
        model = merge_plain(model, dtype=t)
        if check is not None:
            check(model.config)
        return model.to(device).eval(), tok
    if not folder.exists():
        raise RankwiseError(f"{what} {folder} not found; set it to a transformers model folder "
                            "(config.json) or a finished rankwise run folder (config.yaml)")
    if not (folder / "config.json").is_file():
        raise RankwiseError(f"{what} {folder} is neither a transformers model folder (config.json) "
                            "nor a rankwise run folder (config.yaml)")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    if check is not None:
        check(AutoConfig.from_pretrained(folder))
    model = AutoModelForCausalLM.from_pretrained(folder, **dtype_kwargs(t))
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError):
        tok = None
    return model.to(device).eval(), tok


__all__ = ["load_teacher"]
