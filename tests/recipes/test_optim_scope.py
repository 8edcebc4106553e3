"""What an optimizer updates its own way (:mod:`rankwise.recipes.optim_scope`), counted on a
model built in code: tiny BERT, 2 blocks of 16-wide q, k, v, o and a 32 x 16 / 16 x 32 MLP."""
from __future__ import annotations

import pytest

import rankwise
from rankwise.errors import RankwiseError
from rankwise.recipes import optim_scope
from rankwise.testing import tiny_bert_cls

BLOCK = 2 * (4 * 16 * 16 + 2 * 16 * 32)  # the 12 block matrices


def _scope(optim: str, method: str | None = None, **kw):
    model = tiny_bert_cls()
    if method:
        rankwise.apply(model, method, r=2, targets=["query", "value"])
    return optim_scope.scope(rankwise.optimizer(model, optim, **kw)), model


@pytest.mark.parametrize("optim", ["galore", "galore-is", "sumo", "q3r"])
def test_full_training_counts_the_block_matrices(optim):
    s, model = _scope(optim, rank=4)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert (s.tensors, s.params, s.total_params) == (12, BLOCK, total)
    assert s.total_tensors == sum(1 for p in model.parameters() if p.requires_grad)
    assert s.unprojected == 0  # rank 4 (Q3R: 4 x the aspect ratio, 8) < 16 on every matrix


def test_a_rank_that_covers_a_side_is_counted_as_no_reduction():
    s, _ = _scope("galore", rank=16)  # 16 >= the smaller side of every block matrix
    assert (s.tensors, s.unprojected) == (12, 12)
    assert "12 of them have optim.rank >= their smaller side" in optim_scope.describe(s, "galore")


def test_lora_gives_them_nothing_and_is_refused():
    for optim in ("galore", "sumo", "q3r", "t-signsgd"):
        kw = {"total_steps": 10} if optim == "t-signsgd" else {}
        s, model = _scope(optim, "lora", **kw)
        assert s.tensors == 0 and s.total_tensors == 2 * 2 * 2 + 2  # 8 factors, the head's 2
        with pytest.raises(RankwiseError, match="trains none of them"):
            optim_scope.check(rankwise.optimizer(model, optim, **kw), optim, "lora")
    assert optim_scope.scope(rankwise.optimizer(tiny_bert_cls(), "adamw")) is None
    assert optim_scope.metrics(None) == {}
