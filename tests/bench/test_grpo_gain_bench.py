"""``bench grpo-gain``'s data and reward: the SFT, GRPO and evaluation records are disjoint and
spread over the packages, and the configured reward, read from the completion alone, gives each
record's own ``def`` line 1.0 and another record's 0.0 (the run itself is a measurement)."""
from __future__ import annotations

from rankwise_bench import grpo_gain as bench
from rankwise.tasks.grpo.rewards import resolve


def test_the_splits_are_disjoint_and_sized():
    parts = bench.split_records()
    ids = {k: [r["id"] for r in v] for k, v in parts.items()}
    assert (len(ids["rl"]), len(ids["eval"])) == (bench.RL, bench.EVAL)
    assert len(set(ids["sft"]) | set(ids["rl"]) | set(ids["eval"])) == sum(len(v) for v in ids.values())
    assert all(len(r["prompt"].split()) <= bench.PROMPT_WORDS for r in parts["eval"])
    # every k-th record: the held-out prompts come from at least 6 of the 8 packages
    assert len({i.split(":")[0].split(".")[0] for i in ids["eval"]}) >= 6


def test_the_reward_reads_the_function_from_the_completion():
    recs = bench.split_records()["eval"][:4]
    fn = resolve(bench.REWARD)
    ids = [r["id"] for r in recs]
    assert fn(prompts=[""] * 4, completions=[r["completion"] for r in recs], id=ids) == [1.0] * 4
    shifted = [recs[(i + 1) % 4]["completion"] for i in range(4)]
    assert fn(prompts=[""] * 4, completions=shifted, id=ids) == [0.0] * 4


def test_markdown_renders_the_means_from_the_record():
    run = {"start": 0.1, "final": 0.2, "curve": [[0, 0.1], [4, 0.2]], "steps_to_target": 4, "curve_mean": 0.2,
           "train_reward_first5": 0.05, "train_reward_last5": 0.25}
    res = {"runs": {"uniform/0": run, "uniform/1": {**run, "final": 0.4, "steps_to_target": None}},
           "sft": {"steps": 200, "lr": 5e-4, "records": 1207, "eval_loss": 1.5}, "gain": 0.05, "steps": 32,
           "lr": 0.003, "every": 4, "rl_prompts": 128, "eval_prompts": 64, "prompt_words": 32, "new_tokens": 24,
           "temperature": 0.7, "pool": 32, "out": "x"}
    text = bench.markdown(res)
    assert "| uniform mean | | 0.100 | 0.300 | 0.200 | [4, None] | |" in text
    assert "| uniform | 0 | 0.100 | 0.200 | 0.200 | 4 | 0.050 → 0.250 |" in text
