"""``train.distributed_step_timeout_s``: from the end of the first step on, the collective timeout
(and the key a lost-peer message names) is the step one; start-up keeps
``train.distributed_timeout_s``. The real timeout is exercised by the dead/stuck torchrun test."""
from __future__ import annotations

import dataclasses

import pytest

from rankwise.engine.distributed import Distributed, StepTimeout
from rankwise.errors import RankwiseError
from rankwise.recipes.config import load_run_config


def test_the_key_is_validated():
    base = {"model": {"path": "tiny-bert"}}
    assert load_run_config(None, base=base).train.distributed_step_timeout_s is None
    assert load_run_config(None, ["train.distributed_step_timeout_s=5"], base=base).train.distributed_step_timeout_s == 5
    with pytest.raises(RankwiseError, match="distributed_step_timeout_s: got 0.0; expected seconds > 0"):
        load_run_config(None, ["train.distributed_step_timeout_s=0"], base=base)


def test_the_step_timeout_starts_after_the_first_step_and_is_named():
    dist = Distributed(timeout_s=30.0)
    hook = StepTimeout(dist, 10.0)
    assert (dist.timeout_s, dist.timeout_key) == (30.0, "train.distributed_timeout_s")
    hook.on_step_end(None, None, None)
    assert (dist.timeout_s, dist.timeout_key) == (10.0, "train.distributed_step_timeout_s")
    two = dataclasses.replace(dist, world=2)          # the message of a lost peer, without a group
    with pytest.raises(RankwiseError, match=r"waited more than train.distributed_step_timeout_s=10s"):
        with two.guard():
            raise RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete")
