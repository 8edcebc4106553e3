"""Adding a task touches only its own module plus one registration.

The task below (next-token prediction with label smoothing, ``(1 - eps) CE + eps * mean_v(-log p_v)``)
is written the way a new package under ``rankwise/tasks/`` would be - a config dataclass with
its own checks, a task, an example - and registered with one ``registry.register`` call.
Nothing else in rankwise is edited, yet ``task: {name: test-smooth-lm, smoothing: 0.1}`` is
validated by its config class, it passes the task contract (collate, loss, evaluation, a run
and an exact resume) and ``rankwise list`` shows it.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from click.testing import CliRunner
from torch.nn import functional as F

from rankwise import registry
from rankwise.cli import main
from rankwise.engine.task import IGNORE, TaskConfig
from rankwise.errors import RankwiseError
from rankwise.recipes.config import build_run_config
from rankwise.tasks import CausalLMTask
from rankwise.tasks.common import lm_example
from rankwise.testing import tiny_batch, tiny_llama_lm
from tests.tasks.test_task_contract import check_run, check_steps

NAME = "test-smooth-lm"


@dataclass
class SmoothConfig(TaskConfig):
    """``task: {name: test-smooth-lm, smoothing: ...}``."""

    name: str = NAME
    smoothing: float = 0.1

    def problems(self):
        return [] if 0.0 <= self.smoothing < 1.0 else [f"smoothing: got {self.smoothing}; expected [0, 1)"]

    def run_problems(self, run):
        return ["data.packing is not supported by test-smooth-lm; remove it"] if run.data.packing else []


class SmoothTask(CausalLMTask):
    """Causal LM whose targets are label-smoothed (summed over the target tokens)."""

    name = NAME

    def __init__(self, config: SmoothConfig | None = None) -> None:
        super().__init__(config or SmoothConfig())

    @classmethod
    def example(cls, folder):
        return lm_example(folder, {"name": NAME, "smoothing": 0.2})

    def loss_sum(self, model, batch):
        out, batch = self._forward(model, batch)
        logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]   # (B, T-1, V), (B, T-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                               ignore_index=IGNORE, reduction="sum",
                               label_smoothing=self.config.smoothing)
        return loss, out


registry.register("task", NAME, SmoothConfig, SmoothTask, summary="test task: label-smoothed causal LM")


def test_its_loss_is_torch_label_smoothing_and_zero_smoothing_is_the_causal_lm():
    model, batch = tiny_llama_lm(), tiny_batch("llama")
    task = SmoothTask(SmoothConfig(smoothing=0.3))
    batch = task.collate([{"input_ids": row.tolist()} for row in batch["input_ids"]], 0)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1)                       # (B, T-1, V)
    target = batch["labels"][:, 1:]
    mask = target != IGNORE
    nll = -logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    by_hand = (0.7 * nll - 0.3 * logp.mean(-1))[mask].sum()
    assert float(task.loss_sum(model, batch)[0]) == pytest.approx(float(by_hand), rel=1e-5)
    plain = float(CausalLMTask().loss_sum(model, batch)[0])
    assert float(SmoothTask(SmoothConfig(smoothing=0.0)).loss_sum(model, batch)[0]) == pytest.approx(plain, rel=1e-6)


def test_its_section_is_typed_and_checked_by_its_own_config():
    cfg = build_run_config({"model": {"path": "tiny-llama"}, "task": {"name": NAME, "smoothing": 0.25}})
    assert isinstance(cfg.task, SmoothConfig) and cfg.task.smoothing == 0.25
    assert cfg.to_dict()["task"] == {"name": NAME, "smoothing": 0.25}
    with pytest.raises(RankwiseError) as err:
        build_run_config({"model": {"path": "tiny-llama"}, "data": {"packing": True},
                          "task": {"name": NAME, "smoothing": 1.5, "smoothin": 1}})
    assert "task.smoothin: unknown key" in str(err.value) and "did you mean 'smoothing'" in str(err.value)
    with pytest.raises(RankwiseError, match=r"task.smoothing: got 1.5; expected \[0, 1\)"):
        build_run_config({"model": {"path": "tiny-llama"}, "task": {"name": NAME, "smoothing": 1.5}})
    with pytest.raises(RankwiseError, match="data.packing is not supported by test-smooth-lm"):
        build_run_config({"model": {"path": "tiny-llama"}, "data": {"packing": True}, "task": {"name": NAME}})


def test_rankwise_list_shows_the_task_kind_with_it():
    out = CliRunner().invoke(main, ["list"]).output.splitlines()
    tasks = [line.split()[1] for line in out if line.startswith("task ")]
    assert tasks == registry.names("task") and {"classification", "dpo", "grpo", NAME} <= set(tasks)


def test_it_passes_the_contract_steps(tmp_path):
    check_steps(NAME, tmp_path)


@pytest.mark.slow
def test_it_trains_and_resumes_exactly(tmp_path):
    assert check_run(NAME, tmp_path)["eval_perplexity"] > 1.0
