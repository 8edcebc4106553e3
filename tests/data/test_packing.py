"""Packing: blocks fill well, and a packed example's logits and loss equal its unpacked ones."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from rankwise.data.instruct import load_function_records
from rankwise.data.packing import PackedData, check_packed_attention, pack
from rankwise.data.text import build_data
from rankwise.engine import get_task
from rankwise.errors import RankwiseError
from rankwise.recipes.config import DataConfig
from rankwise.recipes.model import load_model, load_tokenizer

LM = get_task("causal-lm")


def test_pack_places_every_example_once_within_capacity():
    lengths = np.random.default_rng(0).integers(1, 65, size=2000)
    lengths[::97] = 0                                   # dropped examples are skipped
    order, starts = pack(lengths, 64)
    assert sorted(order.tolist()) == np.flatnonzero(lengths).tolist()
    sums = [int(lengths[order[a:b]].sum()) for a, b in zip(starts[:-1], starts[1:])]
    assert max(sums) <= 64 and min(sums) > 0
    lower = int(np.ceil(lengths.sum() / 64))
    assert len(sums) <= lower * 1.02 + 1                # best-fit decreasing: near the bound
    again = pack(lengths, 64)
    assert (again[0] == order).all() and (again[1] == starts).all()


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    path = tmp_path_factory.mktemp("pack") / "f.jsonl"
    recs = load_function_records()[:40]
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n"
                            for r in recs))
    cfg = DataConfig(source=str(path), format="prompt-completion", max_length=96, eval_fraction=0.1,
                     cache_dir=str(path.parent / "cache"))
    return build_data(cfg, LM, load_tokenizer("tiny-llama"))[0]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_packed_logits_and_loss_equal_unpacked(examples, name):
    model, _ = load_model(name, LM, seed=0)
    model.eval()
    packed = PackedData(examples, 96)
    assert len(packed) < len(examples)                  # several examples per block
    blocks = [packed[b] for b in range(len(packed))]
    batch = LM.collate(blocks, examples.pad_id)          # (B, T), padding tail restarts positions
    with torch.no_grad():
        out, _ = LM._forward(model, batch)
        loss_packed, _ = LM.loss_sum(model, batch)
        n_packed = LM.count_targets(batch)
        plain = LM.collate([examples[i] for i in range(len(examples))], examples.pad_id)
        loss_plain, _ = LM.loss_sum(model, plain)
        n_plain = LM.count_targets(plain)
        worst = 0.0
        for b in range(len(packed)):
            pos = 0
            for i in packed.order[packed.starts[b]:packed.starts[b + 1]].tolist():
                ids = examples[i]["input_ids"]
                alone = model(input_ids=torch.tensor([ids])).logits[0]   # (T_i, V)
                here = out.logits[b, pos:pos + len(ids)]
                worst = max(worst, float((here - alone).abs().max()))
                pos += len(ids)
    assert worst < 1e-4, worst
    assert n_packed == n_plain
    assert float(loss_packed) == pytest.approx(float(loss_plain), rel=1e-5)


class _Leaky(nn.Module):
    """A 'language model' whose every position sees all earlier tokens, whatever the positions."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=16)
        self.emb = nn.Embedding(16, 4)

    def forward(self, input_ids, position_ids=None, use_cache=None, **_):
        return SimpleNamespace(logits=self.emb(input_ids).cumsum(1))


def test_a_model_that_ignores_positions_is_refused(examples):
    with pytest.raises(RankwiseError, match="set data.packing: false"):
        check_packed_attention(_Leaky())
    model, _ = load_model("tiny-llama", LM)
    check_packed_attention(model)                        # transformers' Llama is fine
