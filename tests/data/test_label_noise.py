"""``data.label_noise``: exactly round(fraction * n) training labels flipped to another class,
deterministically by ``data.label_noise_seed``; evaluation labels untouched."""
from __future__ import annotations

import pytest

from rankwise.configs import from_dict
from rankwise.data.text import build_data
from rankwise.engine import get_task
from rankwise.errors import RankwiseError
from rankwise.recipes.config import DataConfig
from rankwise.recipes.model import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-bert")


def data(source, **kw):
    return from_dict(DataConfig, {"source": str(source), "max_length": 16, **kw}, "data")


def test_flips_a_fixed_fraction_of_training_labels(docstrings_jsonl, tok):
    task = get_task("classification")
    clean_train, clean_eval = build_data(data(docstrings_jsonl), task, tok)
    noisy_train, noisy_eval = build_data(data(docstrings_jsonl, label_noise=0.4, label_noise_seed=3), task, tok)
    n = len(clean_train)
    wrong = [i for i in range(n) if noisy_train[i]["label"] != clean_train[i]["label"]]
    assert len(wrong) == round(0.4 * n) == len(noisy_train.flipped)
    assert noisy_train.labels == [noisy_train[i]["label"] for i in range(n)]
    assert [r["label"] for r in noisy_train.rows(wrong[:3])] == [noisy_train[i]["label"] for i in wrong[:3]]
    assert [noisy_eval[i]["label"] for i in range(len(noisy_eval))] == \
        [clean_eval[i]["label"] for i in range(len(clean_eval))]
    again, _ = build_data(data(docstrings_jsonl, label_noise=0.4, label_noise_seed=3), task, tok)
    other, _ = build_data(data(docstrings_jsonl, label_noise=0.4, label_noise_seed=4), task, tok)
    assert again.flipped == noisy_train.flipped != other.flipped
    assert noisy_train.pad_id == clean_train.pad_id and len(noisy_train.subset(wrong[:2]).flipped) == 2


def test_bad_label_noise(docstrings_jsonl, tok):
    with pytest.raises(RankwiseError, match="label_noise: got 1.0"):
        data(docstrings_jsonl, label_noise=1.0)
    with pytest.raises(RankwiseError, match="needs task.name: classification"):
        build_data(data(docstrings_jsonl, label_noise=0.2), get_task("causal-lm"), tok)
