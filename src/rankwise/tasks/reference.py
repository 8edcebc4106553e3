"""The reference model of DPO and GRPO: the base (adapters off) or the model as the run started.

``adapters-off`` is the same network with its adapters disabled
(:func:`rankwise.core.ops.disable_adapters`): for an adapter trained from scratch, the model at
step 0. A run that starts from an existing adapter (``model.adapter``) begins elsewhere, and, as
TRL does for a PEFT model that already holds an adapter (a frozen copy named ``ref``), its
reference is the starting model: ``initial``. :class:`WeightSnapshot` keeps a frozen copy of
every trainable tensor at the start (adapter factors, DoRA magnitudes, trainable token rows,
whole trained modules) and a reference forward sees the copies in their place: the parameters'
storage is swapped for the forward (``p.data``), never written, so the policy forward's graph and
the optimizer state are untouched, and no second model exists.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from rankwise.core.ops import disable_adapters
from rankwise.errors import RankwiseError


class WeightSnapshot:
    """Frozen copies of ``model``'s trainable parameters as they are now.

    Args:
        model: The model about to train (its parameters are the ones the optimizer will hold).
    """

    def __init__(self, model: nn.Module) -> None:
        params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        self.pairs = [(p, p.detach().clone()) for p in params]

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Context manager: inside it the trainable parameters hold the saved values (use under
        ``torch.no_grad``)."""
        live = [p.data for p, _ in self.pairs]
        for p, saved in self.pairs:
            p.data = saved
        try:
            yield
        finally:
            for (p, _), data in zip(self.pairs, live):
                p.data = data


def reference(model: nn.Module, snapshot: WeightSnapshot | None) -> contextlib.AbstractContextManager:
    """The context of a reference forward: ``snapshot`` swapped in, else adapters disabled."""
    return snapshot.swapped_in() if snapshot is not None else disable_adapters(model)


def resolve(mode: str, section: str, trains_full: bool, from_adapter: bool, full_default: str) -> str:
    """The reference in force for ``{section}.reference: mode``.

    Args:
        mode: ``auto``, ``adapters-off``, ``initial`` (or a task's own, passed through).
        section: ``dpo`` or ``grpo`` (messages).
        trains_full: The method trains every weight.
        from_adapter: The run starts from ``model.adapter``.
        full_default: What ``auto`` means for full fine-tuning.

    Returns:
        ``auto`` resolved: ``initial`` from a starting adapter, ``full_default`` for full
        fine-tuning, else ``adapters-off``.

    Raises:
        RankwiseError: ``initial`` for an adapter trained from scratch (its start is the base,
            and a resumed run could not rebuild its step-0 values).
    """
    if mode == "auto":
        return "initial" if from_adapter else full_default if trains_full else "adapters-off"
    if mode == "initial" and not (from_adapter or trains_full):
        raise RankwiseError(f"{section}.reference: initial is the model a run starts from "
                            "model.adapter (or a full fine-tune); an adapter trained from scratch "
                            f"starts at the base's output, which adapters-off gives without a copy: "
                            f"set {section}.reference: auto or adapters-off")
    return mode


def reference_problems(mode: str, run: Any) -> list[str]:
    """Why ``run`` has no reference under ``task.reference: mode`` (empty: it has one); the
    run-config check DPO and GRPO share (``run_problems``)."""
    from rankwise import registry
    trains_full = registry.get("method", run.method.name).trains == "full"
    try:
        resolve(mode, "task", trains_full, bool(run.model.adapter), "adapters-off")
    except RankwiseError as err:
        return [str(err)]
    return []


def prepare_reference(task: Any, model: nn.Module, datasets: list, trains_full: bool,
                      precompute: Callable[[Any], list]) -> str:
    """What ``prepare`` does for a task with a reference (``dpo``, ``kto``): switch dropout off
    (``task.disable_dropout``), resolve ``task.reference`` (``auto`` is ``precomputed`` for full
    fine-tuning), and for ``initial`` copy the trainable tensors into ``task.snapshot``
    (:class:`WeightSnapshot`), for ``precomputed`` store ``precompute(data)`` as each dataset's
    ``ref_logps`` (the model as it is now, before the first step).

    Args:
        task: The task (``config.reference``, ``config.disable_dropout``, ``from_adapter``).
        model: The model about to train.
        datasets: The datasets the task's batches come from.
        trains_full: The method trains every weight.
        precompute: A dataset's reference log-probs (:func:`precompute_logps`).

    Returns:
        The reference in force (``adapters-off``, ``precomputed`` or ``initial``).

    Raises:
        RankwiseError: ``initial`` for an adapter trained from scratch.
    """
    mode = resolve(task.config.reference, "task", trains_full, task.from_adapter, "precomputed")
    if task.config.disable_dropout:
        disable_dropout(model)
    if mode == "initial":
        task.snapshot = WeightSnapshot(model)
    if mode == "precomputed":
        for data in datasets:
            data.ref_logps = precompute(data)
    return mode


@torch.no_grad()
def precompute_logps(task: Any, model: nn.Module, data: Any, batch_size: int, device: str,
                     logps: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> list:
    """``logps(batch)`` over every example of ``data`` in batches of ``batch_size`` collated by
    ``task``, in eval mode (so dropout does not enter the reference), as nested lists.

    Args:
        task: Collates the examples (``task.collate(items, data.pad_id)``).
        model: The model whose log-probs are taken (its train/eval mode is restored).
        data: The examples (``len``, indexing, ``pad_id``).
        batch_size: Examples per forward.
        device: Where the batches go.
        logps: A batch's ``(B, k)`` log-probs.

    Returns:
        One ``[k values]`` list per example.
    """
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(data), batch_size):
        items = [data[i] for i in range(start, min(start + batch_size, len(data)))]
        batch = {k: v.to(device) for k, v in task.collate(items, data.pad_id).items()}
        out.extend(logps(batch).cpu().tolist())
    model.train(was_training)
    return out


DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def disable_dropout(model: nn.Module) -> int:
    """Switch every dropout of ``model`` off, as TRL's ``disable_dropout_in_model`` does.

    The reference is the same network (adapters off, or its initial weights swapped in), so with
    dropout on, the policy and reference forwards draw different masks and a fresh LoRA's first
    DPO loss is not ``log 2``. Every dropout module (the base's and the adapters', e.g. LoRA's
    ``lora_dropout``) gets ``p = 0``; so does a float ``attention_dropout`` attribute (Llama,
    Qwen and Mistral attention pass it to the attention kernel instead of holding a module).
    Works in place; the weights are untouched.

    Args:
        model: The model about to train.

    Returns:
        How many dropouts had a non-zero probability.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, DROPOUTS):
            changed += module.p != 0
            module.p = 0.0
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and not isinstance(rate, bool):
            changed += rate != 0
            module.attention_dropout = 0.0
    return int(changed)


__all__ = ["DROPOUTS", "WeightSnapshot", "disable_dropout", "precompute_logps", "prepare_reference", "reference",
           "reference_problems", "resolve"]
