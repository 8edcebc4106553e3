"""The pair tasks' shared pieces (:mod:`rankwise.tasks.pairs`, :mod:`rankwise.tasks.pair_task`):
the encoder on plain text (prefix + ids + EOS, the prompt cut from the left by the same amount on
both sides) and on chat (an unpaired record without a completion is dropped before its prompt's
messages are read, as KTO's encoder did), the chosen-then-rejected batch against hand-padded
rows, the per-pair metrics against hand sums, and the refusals every pair task shares."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rankwise.data.formats import IGNORE, Encoder
from rankwise.errors import RankwiseError
from rankwise.recipes.model import load_tokenizer
from rankwise.tasks.pair_task import add_pair_stats, pair_means, pair_run_problems
from rankwise.tasks.pairs import PairEncoder, by_pair, collate_pairs, cut_prompt, split_side
from tests.tasks.pair_fixtures import CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


def test_plain_text_is_prefix_prompt_completion_eos_and_the_pair_shares_its_cut_prompt(tok):
    pe = PairEncoder(Encoder(tok, "prompt-completion", 12))
    ids = lambda text: list(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    prompt = pe.prompt("def add(a, b): return the sum of both numbers", 1)
    head, chosen = pe.completion(prompt, "return a + b", 1)
    assert head == pe.enc.prefix + ids("def add(a, b): return the sum of both numbers")
    assert chosen == ids("return a + b") + [pe.enc.eos]
    assert pe.encode("def add(a, b): return the sum of both numbers", "return a + b", 1) == (head, chosen)
    assert pe.encode("", "return a + b", 1) is None and pe.encode("x", None, 1) is None
    rejected = ids("pass") + [pe.enc.eos]
    (c_ids, c_labels), (r_ids, r_labels) = pe.fit(head, [chosen, rejected])
    cut = len(c_ids) - len(chosen)                                  # the prompt both sides keep
    assert len(c_ids) == 12 and c_ids[:cut] == r_ids[:len(r_ids) - len(rejected)]
    assert c_ids[:pe.keep] == pe.enc.prefix                         # the special prefix stays
    assert c_ids[cut - 1] == head[-1]                               # cut from the left
    assert c_labels == [IGNORE] * cut + chosen and r_labels == [IGNORE] * cut + rejected
    assert cut_prompt(head, len(chosen), pe.keep, 12) == c_ids[:cut]
    assert pe.fit(head, [[5] * 13]) == [] and cut_prompt(head, 13, pe.keep, 12) is None


def test_chat_completion_is_what_the_conversation_adds_and_a_missing_one_drops_first(tok):
    pe = PairEncoder(Encoder(tok, "chat", 64, chat_template=CHAT_TEMPLATE))
    got = pe.encode("hello", "hi there", 1)
    ids = lambda text: list(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert got == (ids("<user> hello [SEP] <assistant> "), ids("hi there [SEP] "))
    assert pe.keep == 0
    bad = [{"role": "nobody", "content": "x"}]
    assert pe.encode(bad, None, 2) is None                          # no completion: dropped, not read
    with pytest.raises(RankwiseError, match="record 2 message 1 has role 'nobody'"):
        pe.encode(bad, "hi", 2)


def test_the_split_is_a_hash_of_row_and_prompt():
    sides = [split_side(row, f"prompt {row}", 0.25) for row in range(400)]
    assert sides == [split_side(row, f"prompt {row}", 0.25) for row in range(400)]
    assert 60 < sum(sides) < 140 and split_side(3, "p", None) == 0
    assert split_side(7, [{"role": "user", "content": "a"}], 1.0) == 1


def test_pair_batch_is_chosen_rows_then_rejected_rows_right_padded():
    items = [{"chosen_ids": [1, 2, 3], "chosen_labels": [IGNORE, 2, 3], "rejected_ids": [1, 4],
              "rejected_labels": [IGNORE, 4]},
             {"chosen_ids": [5, 6], "chosen_labels": [IGNORE, 6], "rejected_ids": [5, 7, 8, 9],
              "rejected_labels": [IGNORE, 7, 8, 9]}]
    batch = collate_pairs(items, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [5, 6, 0, 0], [1, 4, 0, 0], [5, 7, 8, 9]]
    assert batch["attention_mask"].sum(1).tolist() == [3, 2, 2, 4]
    assert batch["labels"].tolist() == [[IGNORE, 2, 3, IGNORE], [IGNORE, 6, IGNORE, IGNORE],
                                        [IGNORE, 4, IGNORE, IGNORE], [IGNORE, 7, 8, 9]]
    assert set(collate_pairs(items, 0, labels=False)) == {"input_ids", "attention_mask"}
    assert by_pair(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [[1.0, 3.0], [2.0, 4.0]]


def test_pair_metrics_are_means_per_pair_over_batches():
    stats: dict[str, float] = {}
    add_pair_stats(stats, torch.tensor([[1.0, 0.5], [0.0, 2.0]]), torch.tensor([[-3.0, -4.0], [-1.0, -2.0]]))
    add_pair_stats(stats, torch.tensor([[0.25, -1.0]]), torch.tensor([[-5.0, -6.0]]))
    means = pair_means(stats, "eval_")
    assert means == pytest.approx({"eval_reward_accuracy": 2 / 3, "eval_reward_margin": (0.5 - 2.0 + 1.25) / 3,
                                   "eval_reward_chosen": 1.25 / 3, "eval_reward_rejected": 1.5 / 3,
                                   "eval_logps_chosen": -3.0, "eval_logps_rejected": -4.0})
    assert pair_means({}, "") == {}
    assert math.isclose(stats["pairs"], 3.0)


def run_of(**data) -> SimpleNamespace:
    d = {"packing": False, "train_on_prompt": False, "schedule": SimpleNamespace(name="none"), **data}
    return SimpleNamespace(data=SimpleNamespace(**d), eval=SimpleNamespace(samples=0))


def test_pair_tasks_refuse_packing_prompt_targets_and_a_schedule():
    assert pair_run_problems("dpo", run_of()) == []
    assert pair_run_problems("dpo", run_of(packing=True, schedule=SimpleNamespace(name="skrull"))) == [
        "data.packing is not supported with task.name: dpo (pairs are scored whole, on their "
        "completions); remove it",
        "data.schedule: skrull schedules single sequences, and task.name: dpo trains pairs; set "
        "data.schedule: none"]
    assert pair_run_problems("orpo", run_of(train_on_prompt=True), prompt_fix=" (see x)") == [
        "data.train_on_prompt is not supported with task.name: orpo (pairs are scored whole, on "
        "their completions (see x)); remove it"]
    assert pair_run_problems("kto", run_of(schedule=SimpleNamespace(name="skrull")), scored="s",
                             schedule="own") == ["own"]
