"""Gradient clipping follows the optimizer's registration (issue 27 item 3): NGN-M and t-SignSGD
set their own step from the gradient norm, so a default run does not clip; an explicit
``train.grad_clip`` still wins; ``config.yaml`` holds the value in force (``null`` when off).
NGN-M's loss value includes the hook and auxiliary terms whose gradients it steps on."""
import re

import pytest
import torch
import yaml

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.engine import Engine, get_task
from rankwise.recipes.config import load_run_config
from rankwise.testing import tiny_batch, tiny_bert_cls

BASE = {"model": {"path": "tiny-bert", "task": "classification"}, "train": {"steps": 7}}


def _cfg(optim: dict, **train):
    return load_run_config(None, base={**BASE, "optim": optim, "train": {**BASE["train"], **train}})


def test_default_clip_follows_the_registration_and_an_explicit_value_wins():
    assert _cfg({"name": "adamw"}).train.grad_clip == 1.0
    assert _cfg({"name": "ngn-m"}).train.grad_clip is None
    assert _cfg({"name": "t-signsgd"}).train.grad_clip is None
    assert _cfg({"name": "ngn-m"}, grad_clip=0.5).train.grad_clip == 0.5
    assert _cfg({"name": "adamw"}, grad_clip=0).train.grad_clip is None
    assert _cfg({"name": "adamw"}, grad_clip=None).train.grad_clip is None
    with pytest.raises(Exception, match=re.escape("grad_clip: got -1.0; expected a norm >= 0 or null "
                                                  "(null or 0: off; auto: the optimizer's choice)")):
        _cfg({"name": "adamw"}, grad_clip=-1)


def test_tsignsgd_schedule_length_follows_train_steps_unless_set():
    assert _cfg({"name": "t-signsgd"}).optim.total_steps == 7
    assert _cfg({"name": "t-signsgd", "total_steps": 3}).optim.total_steps == 3


class _Data(list):
    pad_id = 0


def _ngn_step(grad_clip, hook_value=3.0):
    """One engine step of NGN-M (c = 0.5, no momentum) on a tiny BERT with a loss hook; returns
    (the optimizer's step size, the objective f, the unclipped ||g||^2)."""
    torch.manual_seed(0)
    model = tiny_bert_cls()
    batch = tiny_batch("bert", batch=4)
    data = _Data({"input_ids": batch["input_ids"][i].tolist(), "label": int(batch["labels"][i])}
                 for i in range(4))
    task = get_task("classification")
    params = [p for p in model.parameters() if p.requires_grad]
    first = params[0]
    hook = {"extra": lambda m, step: hook_value * (first ** 2).sum()}
    model.train()
    loss_sum, _ = task.loss_sum(model, task.collate(list(data), 0))
    f = loss_sum / 4 + hook["extra"](model, 0)
    grads = torch.autograd.grad(f, params, allow_unused=True)
    sq = float(sum((g.double() ** 2).sum() for g in grads if g is not None))
    entry = registry.get("optimizer", "ngn-m")
    opt = entry.builder(model, from_dict(entry.config_cls, {"name": "ngn-m", "lr": 0.5, "momentum": 0.0}, "optim"))
    Engine(model, task, opt, data, batch_size=4, grad_clip=grad_clip, loss_hooks=hook).train_step(0)
    opt.loss_hook.remove()
    return opt.last_step_size, float(f.detach()), sq


def test_ngn_step_size_uses_the_unclipped_norm_and_the_whole_objective_in_a_default_run():
    clip = _cfg({"name": "ngn-m"}).train.grad_clip
    gamma, f, sq = _ngn_step(clip)
    assert sq > 4.0                                            # a clip to 1 would change it
    assert gamma == pytest.approx(0.5 / (1 + 0.5 * sq / (2 * f)), rel=1e-5)
    # an explicit clip wins: the step size then sees the clipped norm, 0.1^2
    gamma_clipped, f, _ = _ngn_step(_cfg({"name": "ngn-m"}, grad_clip=0.1).train.grad_clip)
    assert gamma_clipped == pytest.approx(0.5 / (1 + 0.5 * 0.01 / (2 * f)), rel=1e-4)


@pytest.mark.slow
def test_config_yaml_shows_the_clip_in_force(tmp_path):
    from click.testing import CliRunner

    from rankwise.cli import main
    raw = {**BASE, "data": {"source": "demo", "max_length": 24, "limit": 32},
           "method": {"name": "full"}, "optim": {"name": "ngn-m"},
           "train": {"steps": 1, "batch_size": 8, "progress": False, "save_every": 0}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = CliRunner().invoke(main, ["train", str(path), "--out", str(tmp_path / "run")])
    assert out.exit_code == 0, out.output
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert "grad_clip" in saved["train"] and saved["train"]["grad_clip"] is None
