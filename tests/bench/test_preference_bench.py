"""``bench preference``'s DPO pairs: chosen is a rewarded sample and rejected an unrewarded one of
the same prompt, labels cover the completion + EOS only, and a prompt whose samples are all
rewarded (or all not) gives no pair; QFFT's examples hold no question token."""
from __future__ import annotations

import pytest

import rankwise_bench.preference as bench
from rankwise.data.formats import IGNORE, end_id, special_prefix
from rankwise.recipes.model import load_tokenizer


@pytest.mark.slow
def test_pairs_take_a_rewarded_and_an_unrewarded_sample_of_one_prompt(monkeypatch):
    tok = load_tokenizer("tiny-llama")
    recs = [{"prompt": "return the name\n", "completion": "def get_name(self):", "id": "m:get_name:1"},
            {"prompt": "close it\n", "completion": "def close(self):", "id": "m:close:2"}]
    words = {t: tok(t, add_special_tokens=False)["input_ids"]
             for t in ("def get_name(self):", "def nope(self):", "def close(self):")}
    samples = [words["def nope(self):"], words["def get_name(self):"]] + [words["def nope(self):"]] * 2 \
        + [words["def close(self):"]] * 4                    # prompt 2: every sample rewarded
    monkeypatch.setattr(bench, "SAMPLES", 4)
    monkeypatch.setattr(bench, "answer", lambda model, tok, prompts, **kw: samples[: len(prompts)])
    pairs, counts = bench.preference_pairs(None, tok, recs, seed=0)
    assert counts == {"samples": 8, "rewarded_samples": 5, "pairs": 1} and len(pairs) == 1
    ex, eos = pairs[0], end_id(tok)
    k = sum(1 for v in ex["chosen_labels"] if v == IGNORE)
    assert ex["chosen_ids"][k:] == words["def get_name(self):"] + [eos]
    assert ex["rejected_ids"][k:] == words["def nope(self):"] + [eos]
    assert ex["chosen_ids"][:k] == ex["rejected_ids"][:k] == special_prefix(tok) + tok(
        "return the name\n", add_special_tokens=False)["input_ids"]
    assert ex["chosen_labels"][k:] == ex["chosen_ids"][k:]

    qfft = bench.encode(tok, recs, question_free=True)   # EOS as measured (bench.QFFT_EOS)
    assert bench.QFFT_EOS is True
    assert [x["input_ids"] for x in qfft] == [special_prefix(tok) + words[r["completion"]] + [eos] for r in recs]
