"""``bench preference``: its splits are disjoint and spread (every 5th picked record held out at 4:1);
DPO pairs take a rewarded and an unrewarded sample of one prompt, labels cover the completion +
EOS only, and a prompt whose samples are all rewarded (or none) gives no pair; QFFT's examples
hold no question token and, at ``data.question_free_eos``'s default, no EOS; a tiny base runs
every row end to end (a fresh DPO adapter's first loss is log 2), and a second run reuses the
seed records and regenerates ``results.md`` from ``results.json``."""
from __future__ import annotations

import json
import math
import statistics

import pytest

import rankwise_bench.preference as bench
from rankwise.data.formats import IGNORE, end_id, special_prefix
from rankwise.recipes.model import load_tokenizer


def test_the_splits_are_disjoint_and_every_fifth_picked_record_is_held_out(monkeypatch):
    monkeypatch.setattr(bench, "TRAIN", 40)
    monkeypatch.setattr(bench, "HELD_OUT", 10)
    train, held = bench.records()
    assert len(train) == 40 and len(held) == 10
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    assert all(len(r["prompt"].split()) <= bench.PROMPT_WORDS and r["prompt"].endswith("\n") for r in train + held)
    picked = sorted(train + held, key=lambda r: r["id"])
    assert [r["id"] for k, r in enumerate(picked) if k % 5 == 0] == [r["id"] for r in held]
    assert len({r["id"].split(".")[0].split(":")[0] for r in train}) > 3     # spread over the packages


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
    assert counts == {"samples": 8, "rewarded_samples": 5, "pairs": 1, "all_rewarded_prompts": 1}
    assert len(pairs) == 1
    ex, eos = pairs[0], end_id(tok)
    k = sum(1 for v in ex["chosen_labels"] if v == IGNORE)
    assert ex["chosen_ids"][k:] == words["def get_name(self):"] + [eos]
    assert ex["rejected_ids"][k:] == words["def nope(self):"] + [eos]
    assert ex["chosen_ids"][:k] == ex["rejected_ids"][:k] == special_prefix(tok) + tok(
        "return the name\n", add_special_tokens=False)["input_ids"]
    assert ex["chosen_labels"][k:] == ex["chosen_ids"][k:]

    qfft = bench.encode(tok, recs, question_free=True)   # data.question_free_eos's default: no EOS
    assert bench.QFFT_EOS is False
    assert [x["input_ids"] for x in qfft] == [special_prefix(tok) + words[r["completion"]] for r in recs]
    sft = bench.encode(tok, recs, question_free=False)
    assert sft[0]["input_ids"][-1] == eos and sft[0]["labels"][:k] == [IGNORE] * k


@pytest.mark.slow
def test_a_tiny_base_runs_every_row_and_a_second_run_reuses_the_seed_records(tmp_path, monkeypatch):
    from rankwise_bench.base_text import tiny_base
    base = tiny_base(tmp_path / "base")
    for name, value in {"SEEDS": (0, 1), "TRAIN": 8, "HELD_OUT": 2, "PROMPT_WORDS": 6, "MAX_LEN": 40,
                        "NEW_TOKENS": 6, "SFT_STEPS": 2, "SFT_BATCH": 4, "SAMPLES": 2, "DPO_STEPS": 2,
                        "DPO_BATCH": 4}.items():
        monkeypatch.setattr(bench, name, value)
    calls = []

    def alternate(prompts, completions, **columns):     # samples 0, 2, ... rewarded: a pair per prompt
        calls.append(len(completions))
        return [float(i % 2 == 0) for i in range(len(completions))]
    monkeypatch.setattr("rankwise.data.instruct.def_line_reward", alternate)
    out = tmp_path / "out"
    res = bench.run(out, base=base)
    assert sorted(p.name for p in out.iterdir()) == ["preference.png", "results.json", "results.md",
                                                     "seed-0.json", "seed-1.json"]
    for s in res["seeds"]:
        assert s["dpo"]["pairs"] == {"samples": 16, "rewarded_samples": 8, "pairs": 8, "all_rewarded_prompts": 0}
        assert s["dpo"]["first_loss"] == pytest.approx(math.log(2), abs=1e-5)  # fresh LoRA: policy = reference
        for m in bench.METHODS:
            assert s[m]["train"]["reward"] == 0.5 and s[m]["held_out"]["reward"] == 0.5     # 8 and 2 answers
            assert 0 <= s[m]["train"]["length"] <= 6
    assert res["seeds"][0]["base"] == res["seeds"][1]["base"]                 # the base does not depend on the seed
    lengths = [s["sft"]["held_out"]["length"] for s in res["seeds"]]
    got = res["summary"]["sft/held_out"]["length"]
    assert got["mean"] == pytest.approx(statistics.fmean(lengths))
    assert got["std"] == pytest.approx(statistics.stdev(lengths))

    monkeypatch.setattr(bench, "one_seed", lambda *a: pytest.fail("a recorded seed ran again"))
    again = bench.run(out, base=base)
    assert again["seeds"] == res["seeds"]
    md = (out / "results.md").read_text()
    assert md == bench.markdown(json.loads((out / "results.json").read_text()))
    assert "| DPO after SFT | held-out | 0.500 ± 0.000 (0.500, 0.500) |" in md
    assert "seed 1: 8 pairs from 16 samples" in md
