"""``bench kto``: its unpaired examples alternate desirable and undesirable and fit, TRL is handed
rankwise's batch (KL rows included), and the two sides' steps give the same losses (the bench's
own measuring is ``bench dpo``'s, tested in test_dpo_bench.py)."""
from __future__ import annotations

import pytest
import torch

from rankwise.recipes.model import load_tokenizer
from rankwise_bench import kto


def test_examples_alternate_labels_and_fit_the_length():
    tok = load_tokenizer("tiny-llama")
    data = kto.examples(tok, n=12)
    assert len(data) == 12 and [e["label"] for e in data.examples] == [True, False] * 6
    assert all(len(e["prompt_ids"]) + len(e["completion_ids"]) <= kto.MAX_LEN for e in data.examples)
    good, bad = data.examples[0], data.examples[1]
    assert good["completion_ids"] != bad["completion_ids"] and good["completion_ids"][-1] == bad["completion_ids"][-1]


def test_trl_gets_the_same_rows_and_their_kl_rows():
    from rankwise.tasks.kto.task import KTOTask
    tok = load_tokenizer("tiny-llama")
    batch = KTOTask().collate([kto.examples(tok, n=4)[i] for i in range(4)], tok.pad_token_id)
    inputs = kto.trl_inputs(batch)
    assert torch.equal(inputs["KL_input_ids"], batch["kl_input_ids"]) and inputs["label"].tolist() == [True, False] * 2
    assert torch.equal(inputs["completion_mask"].bool(), batch["labels"] != -100)
    assert torch.equal(inputs["KL_completion_mask"].bool(), batch["kl_labels"] != -100)


@pytest.mark.slow  # imports TRL and steps the bench's 30k-vocabulary model on both sides
def test_both_sides_step_to_the_same_losses(tmp_path):
    pytest.importorskip("trl")
    tok = load_tokenizer("tiny-llama")
    torch.manual_seed(0)
    ours, trainer = kto._build(tok, tmp_path)
    mine, theirs = kto._steps(ours, trainer, kto.examples(tok, n=16))
    first = mine(0), theirs(0)
    assert first[0] == pytest.approx(0.5, abs=1e-6) and first[1] == pytest.approx(0.5, abs=1e-6)  # B = 0
    for k in (1, 2):
        assert mine(k) == pytest.approx(theirs(k), abs=1e-5)
