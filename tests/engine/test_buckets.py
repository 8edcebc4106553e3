"""Length buckets (``train.compile_buckets``): the lengths each setting gives, and padding that
is masked, so a padded batch has the targets, tokens and loss of the unpadded one."""
from __future__ import annotations

import pytest
import torch

from rankwise.engine.buckets import bucket_for, bucket_lengths, pad_to_bucket
from rankwise.tasks import CausalLMTask
from rankwise.testing import tiny_llama_lm


def test_bucket_lengths_of_each_setting():
    assert bucket_lengths("pow2", 512) == (64, 128, 256, 512)
    assert bucket_lengths("pow2", 1000) == (64, 128, 256, 512, 1000)
    assert bucket_lengths("pow2", 48) == (48,)                   # below the smallest: one bucket
    assert bucket_lengths(64, 200) == (64, 128, 192, 200)
    assert bucket_lengths([100, 30, 0], 64) == (30, 64)          # max_length added, 0 and 100 dropped
    assert bucket_lengths(0, 512) == ()
    assert [bucket_for(w, (16, 32)) for w in (1, 16, 17, 32, 40)] == [16, 16, 32, 32, 40]


def test_padding_is_masked_and_positions_continue():
    batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
             "labels": torch.tensor([[5, 6, 7], [8, 9, -100]]),
             "position_ids": torch.tensor([[0, 1, 2], [0, 1, 0]]),
             "weights": torch.tensor([1.0, 2.0])}
    out = pad_to_bucket(batch, (2, 5), pad_id=3)
    assert out["input_ids"].tolist() == [[5, 6, 7, 3, 3], [8, 9, 0, 3, 3]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert out["labels"].tolist() == [[5, 6, 7, -100, -100], [8, 9, -100, -100, -100]]
    # a full row's tail is a new segment from 0; a padded row's tail continues its own
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert out["weights"] is batch["weights"]
    assert pad_to_bucket(batch, (3, 8), 3) is batch and pad_to_bucket(batch, (), 3) is batch


def test_each_prefix_takes_its_own_bucket_and_an_unknown_tensor_is_left_alone():
    kto = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long),
           "kl_input_ids": torch.ones(2, 6, dtype=torch.long), "kl_attention_mask": torch.ones(2, 6, dtype=torch.long),
           "desirable": torch.tensor([True, False])}
    out = pad_to_bucket(kto, (4, 8), pad_id=0)
    assert out["input_ids"].shape == (2, 4) and out["kl_input_ids"].shape == (2, 8)
    assert int(out["kl_attention_mask"].sum()) == 12
    cls = {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.tensor([1, 0])}  # class labels
    out = pad_to_bucket(cls, (4,), 0)
    assert out["input_ids"].shape == (2, 4) and out["labels"] is cls["labels"]
    knn = {"input_ids": torch.ones(2, 3, dtype=torch.long), "knn_ids": torch.zeros(2, 2, 4)}  # (B, T-1, K)
    assert pad_to_bucket(knn, (8,), 0) is knn


def test_a_padded_batch_has_the_unpadded_loss():
    model, task = tiny_llama_lm(), CausalLMTask()
    g = torch.Generator().manual_seed(0)
    items = [{"input_ids": torch.randint(1, 64, (n,), generator=g).tolist()} for n in (5, 11, 3)]
    batch = task.collate(items, 0)                                          # (3, 11)
    padded = pad_to_bucket(batch, (16, 32), 0)                              # (3, 16)
    assert padded["input_ids"].shape == (3, 16)
    assert task.count_targets(padded) == task.count_targets(batch) == 4 + 10 + 2
    with torch.no_grad():
        plain, big = float(task.loss_sum(model, batch)[0]), float(task.loss_sum(model, padded)[0])
    assert big == pytest.approx(plain, rel=1e-6)
