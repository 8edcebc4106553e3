"""The task contract: every registered task (kind ``task``) through collate, loss, evaluation,
a smoke run and an exact resume, on its own example (``Task.example``: a tiny in-code model).

A task defined outside the package passes the same checks with nothing else edited
(``tests/tasks/test_task_extension.py`` calls :func:`check_steps` and :func:`check_run`).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from rankwise import registry
from rankwise.recipes.config import build_run_config
from rankwise.recipes.train import train
from rankwise.recipes.session import prepare

NEEDS = {"memory-decoder": "faiss"}  # a task's optional dependency


def example_config(name: str, folder: Path, **train_keys):
    """The validated run config of task ``name``'s example (data written into ``folder``)."""
    cls = registry.get("task", name).builder
    raw = cls.example(folder)
    assert raw is not None, f"task {name!r} has no example(folder): the contract needs one"
    assert raw["task"]["name"] == name
    raw["train"] = {**raw.get("train", {}), **train_keys}
    return build_run_config(json.loads(json.dumps(raw)), notice=False)


def check_steps(name: str, folder: Path) -> None:
    """Collate, loss and evaluation of task ``name`` on its example.

    * every micro-batch of step 0, as the loss reads it (after ``before_step``, in train mode as
      the engine calls it), has rows and targets; its ``loss_sum`` is finite, the same on a second
      forward (the same seed: dropout draws alike), and its ``mean_loss`` is
      ``loss_sum / count_targets``;
    * the gradient of the loss reaches the trainable parameters;
    * evaluation gives a finite ``eval_loss`` and the same metrics with batches of 1 as with one
      batch (the sums and counts add up over batches).
    """
    session = prepare(example_config(name, folder), device="cpu")
    task, model = session.task, session.model
    engine = session.engine()
    model.train()
    batches = task.before_step(model, engine.step_batches(0), 0, session.cfg.train.seed)
    assert batches and all(len(b["input_ids"]) > 0 for b in batches)
    for batch in batches:
        n = task.count_targets(batch)
        assert isinstance(n, int) and n > 0
        with torch.no_grad():
            first, again, mean = (float(_seeded(fn, model, batch)) for fn in
                                  (lambda m, b: task.loss_sum(m, b)[0], lambda m, b: task.loss_sum(m, b)[0],
                                   task.mean_loss))
        assert math.isfinite(first) and first == pytest.approx(again, rel=1e-6, abs=1e-7)
        assert mean == pytest.approx(first / n, rel=1e-6, abs=1e-7)
    model.zero_grad(set_to_none=True)
    _seeded(lambda m, b: task.loss_sum(m, b)[0], model, batches[0]).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert any(g is not None and float(g.abs().sum()) > 0 for g in grads), "no gradient reached the model"
    model.zero_grad(set_to_none=True)
    whole = engine.evaluate(session.eval_data, 64)
    ones = engine.evaluate(session.eval_data, 1)
    assert math.isfinite(whole["eval_loss"]) and set(whole) == set(ones)
    for key, value in whole.items():
        assert ones[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def _seeded(fn, model, batch):
    torch.manual_seed(0)
    return fn(model, batch)


def check_run(name: str, folder: Path) -> dict:
    """A 2-step run of task ``name``'s example through ``rankwise train``'s recipe writes its
    metrics; resumed from the step-1 checkpoint it ends with the same metrics (exact resume).

    Returns:
        The run's metrics.
    """
    data, out = folder / "data", folder / "run"
    data.mkdir()
    full = train(example_config(name, data, steps=2, save_every=1), out)
    assert math.isfinite(full["eval_loss"]) and json.loads((out / "metrics.json").read_text()) == full
    part = folder / "part"
    shutil.copytree(out, part)
    shutil.rmtree(part / "checkpoints" / "step-0000002")
    (part / "metrics.json").unlink()
    resumed = train(example_config(name, data, steps=2, save_every=1), part, resume=True)
    evals = [k for k in full if k.startswith("eval_")]
    assert evals and all(resumed[k] == pytest.approx(full[k], rel=1e-5, abs=1e-7) for k in evals), \
        ({k: full[k] for k in evals}, {k: resumed.get(k) for k in evals})
    return full


def _skip_without_needs(name: str) -> None:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])


@pytest.mark.parametrize("name", registry.names("task"))
def test_collate_loss_and_evaluation(name, tmp_path):
    _skip_without_needs(name)
    check_steps(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", registry.names("task"))
def test_smoke_run_and_exact_resume(name, tmp_path):
    _skip_without_needs(name)
    check_run(name, tmp_path)


def test_every_built_in_task_has_a_typed_section():
    for name in ("classification", "causal-lm", "dpo", "grpo", "memory-decoder", "orpo", "simpo", "reward"):
        entry = registry.get("task", name)
        assert entry.config_cls().name == name and entry.builder.name == name
